"""The comparison report: statistics, plots and the Markdown / HTML document."""
