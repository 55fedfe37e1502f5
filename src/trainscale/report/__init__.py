"""Tables and reports built from run folders."""
