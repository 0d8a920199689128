"""EAGLE-3 drafter pipeline: the library under the six numbered stage scripts."""
