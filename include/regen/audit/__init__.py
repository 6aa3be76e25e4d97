"""The loss-mask audit: findings (its data model), rules (one sample), dataset (a whole
dataset, with its report), report (report.html) and viewer (the samples shown)."""
