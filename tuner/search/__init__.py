"""The search: one Optuna study per key (`study`), a family's M ladder and its
measured M map (`ladder`), and tuning on several GPUs at once (`workers`)."""
