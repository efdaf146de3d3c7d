"""``mpitrain bench ...``: measurements printed as ratios taken side by side in one run."""
