"""The web page: static HTML, CSS and JavaScript modules, shipped as package data (no build step).

The page is a client of the public API like any other; `routes/ui.py` serves these files.
"""
