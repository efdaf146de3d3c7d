"""One module per way of spreading training over ranks; each stands alone (see ARCHITECTURE.md)."""
