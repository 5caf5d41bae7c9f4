"""The process and the OS: signals, rlimits, scratch space, opening inputs
safely, kernel copies, threads."""
