"""The connector interface, its factory and the built-in connectors."""
