# The same number as pdserve's (src/pdserve/_version.py); pdserve-bench requires exactly that pdserve.
__version__ = "0.1.0"
