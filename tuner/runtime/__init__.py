"""Serving the decisions: the lookup rule (`lookup`), `gemm` (`dispatch`),
tuning on first sight (`online`) and a model's linear layers (`patch`,
`linears`)."""
