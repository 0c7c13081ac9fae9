"""Sphinx settings of the course's website (built by docs/build_site.py, not directly)."""

project = "ddp-course"
author = "ddp-course authors"
extensions = ["myst_nb"]
# The site shows the committed outputs: one clean run per notebook, nothing re-run.
nb_execution_mode = "off"
# Markdown that cells display (tables included) renders as GitHub-flavoured Markdown.
nb_render_markdown_format = "gfm"
myst_heading_anchors = 3
html_theme = "furo"
html_title = "ddp-course"
html_copy_source = False
html_show_sourcelink = False
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
# MyST's heading-level check is about style, not broken output.
suppress_warnings = ["myst.header"]
# Text as written: quotes and dashes stay what the README and the lessons typed.
smartquotes = False
