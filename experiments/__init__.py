"""The falsification harness: does performance fall with batch size for the corrected layers?

Modules (flat, one job each):
    data            datasets (digits, fashion-mnist, cifar10, synthetic), split, standardised, fingerprinted
    data_raw        the arrays a data source hands over, checked once for all sources
    data_idx        the IDX container (MNIST, Fashion-MNIST);  data_fashion  Fashion-MNIST from IDX files
    data_cifar      CIFAR-10 from the official pickle release, checksummed
    data_synthetic  a teacher-student task whose inputs share a component of tunable weight
    models          MLP / CNN built from a method name (which layer every hidden layer is)
    training        one run: plain SGD (or momentum, Adam), explicit budget, LR rule per batch size
    store           SQLite results, one transaction per finished run, keyed by the config hash
    sweep           a grid of runs in parallel workers, resumed after any interruption
    presets         TOML presets (smoke, fashion, paper) -> studies of run configs
    stats           trend estimators and tests (clustered OLS, mixed model, Page's L, bootstrap, Holm)
    analysis        the decision rule: verdicts per method and group from the records
    calibration     the tests' error rates and power on simulated sweeps with a planted slope
    figures         the report's figures (matplotlib, no pyplot state)
    report          the written report (Markdown, HTML, summary.json, LaTeX)
    probe           ``affdiv probe``: the update alignment behind the prediction, on real data
    cli             ``affdiv falsify`` and ``affdiv analyse``
"""
