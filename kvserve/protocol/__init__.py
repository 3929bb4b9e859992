"""Messages passed between the engine's layers and processes (all leaf types, no logic)."""
