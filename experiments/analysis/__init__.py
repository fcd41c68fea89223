"""Analysis of the records: its settings (settings), the two designs behind one shape (design),
trend statistics (stats), the fixed-budget rule (decision, contrast), the steps-to-target rule
(critical_batch), the runs analysed together (groups), and the rules' error rates on simulated
studies (calibration)."""
