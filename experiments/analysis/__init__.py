"""Analysis of the records: trend statistics (stats), the decision rule (decision), the runs
analysed together (groups), and the tests' error rates on simulated studies (calibration)."""
