"""What each command does, on logical tensors: selection, measuring, planning,
executing, diff. No file format, no output path."""
