"""Small leaf utilities shared by every layer (no kvserve imports above this package)."""
