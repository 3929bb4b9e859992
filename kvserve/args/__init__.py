"""The engine's arguments: flags and keyword arguments validated into an EngineConfig.
Apart from the front end and the engine core, which both take the config they produce."""
