"""The zoo: which recipe is known to work for which Llama model. Its data (models/, results.json) and the code that
measures it (matrix.py, on Ray) and writes its tables and plots (report.py, plots.py) live side by side."""
