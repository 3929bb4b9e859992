"""Built-in connectors; the factory imports each one only when it is asked for."""
