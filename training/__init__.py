"""Draft-head (EAGLE-3) training. Filled in by the speculative-decoding work."""
