"""One job from checkpoint to report: run, prepare, and the stages they report."""
