"""One module per file format behind the small interface in base.py."""
