"""Runs: what determines one (config), what it trains (models), how (training), where its result
goes (store), many of them in parallel (sweep), and the named grids of them (presets)."""
