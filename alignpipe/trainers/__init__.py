"""Our trainers (one per file), following the designs of TRL's trainers. Configs live in `configs.py`,
which imports no torch so that recipes validate fast."""
