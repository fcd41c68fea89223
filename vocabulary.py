"""The words of a study, defined once: the verdicts, the classes of a B_crit ratio, the two
designs and their metric, and the methods the prediction is about by default.

Torch-free and free of every optional library, so that the command line's help can state the
defaults without importing the harness.
"""

# A corrected method's verdict, and the study's joint one.
SUPPORTED = "supported"
CONTRADICTED = "contradicted"
INCONCLUSIVE = "inconclusive"
MIXED = "mixed"  # across groups or pairs: supported in some, contradicted in others
NO_PREDICTION = "no prediction"  # a method that is neither corrected nor a baseline
REFERENCE = "reference"  # a baseline of the steps-to-target design: the reference of the ratios
JOINT_VERDICTS = (SUPPORTED, CONTRADICTED, MIXED, INCONCLUSIVE)

# The class of a ratio r = B_crit(corrected) / B_crit(baseline) against the equivalence band.
SMALLER = "smaller"  # below 1 and not shown inside the band
SMALLER_WITHIN_MARGIN = "smaller_within_margin"  # below 1 and inside the band
EQUIVALENT = "equivalent"  # not below 1, inside the band
LARGER = "larger"  # above 1
UNCLEAR = "unclear"
RATIO_CLASSES = (SMALLER, SMALLER_WITHIN_MARGIN, EQUIVALENT, LARGER, UNCLEAR)

# The designs, by the name summary.json records, and the metric of the steps-to-target design.
FIXED_BUDGET = "fixed budget"
STEPS_TO_TARGET = "steps_to_target"
TARGET_METRIC = "steps_to_target"

# The methods the prediction is about, and those they are compared against, by default.
DEFAULT_CORRECTED = ("affine_like", "norm_l2", "patchnorm")
DEFAULT_BASELINES = ("affine", "batchnorm")
