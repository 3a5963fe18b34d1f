"""Accuracy evals: does a stack keep its target's accuracy, and at what speed?

`gsm8k` and `humaneval` turn data into prompts and score outputs; `sandbox` runs untrusted programs;
`records` keeps per-sample results (resumable); `runner` drives configs over a task; `report` and
`stats` compare configs. Task settings (prompts, limits) live in the repository's `evals/` folder.
"""
