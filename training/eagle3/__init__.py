"""EAGLE-3 draft-head training: regenerate -> features -> vocab + TTT training -> speculators export
(`python -m training.eagle3 --help`)."""
