"""The one way OUT is written: targets, checks against the input, staging, the commit point."""
