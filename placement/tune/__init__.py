"""Rules that turn monitor evidence into re-binding actions, judged and rolled back when they do not help."""
