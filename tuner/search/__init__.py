"""The search: one Optuna study per key (`study`), a family's M ladder and its
measured M map (`ladder`), tuning on several GPUs at once (`workers`) and
what a tune shows a person (`progress`)."""
