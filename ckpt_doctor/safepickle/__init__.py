"""The pickle core, at the bottom of the import graph: one policy table (policy), one static walker (walker), one
safe unpickler (unpickler) and every resource bound (limits). scan, every reader and the broken-file path stand on
it, so no two commands can disagree about what a file would run."""
