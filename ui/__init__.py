"""The app's side: its jobs, each in its own process and folder."""
