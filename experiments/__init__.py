"""The falsification harness: does performance fall with batch size for the corrected layers?

Modules (flat, one job each):
    data        datasets (digits, fashion-mnist, cifar10, synthetic), split, standardised, fingerprinted
    models      MLP / CNN built from a method name (which layer every hidden layer is)
    training    one run: plain SGD (or momentum, Adam), explicit budget, LR rule per batch size
    store       SQLite results, one transaction per finished run, keyed by the config hash
    sweep       a grid of runs in parallel workers, resumed after any interruption
    presets     TOML presets (smoke, fashion, paper) -> studies of run configs
    analysis    the statistics and the decision rule;  report  the written report
    cli         ``affdiv falsify`` and ``affdiv analyse``
"""
