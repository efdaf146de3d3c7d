"""One module per way of spreading training over ranks; each stands alone: it imports the base and
:mod:`mpitrain.comm`, never another strategy (``tests/test_architecture.py`` checks the imports)."""
