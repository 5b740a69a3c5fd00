"""Training a pruned or merged model back towards its original: distillation loop, low-rank adapter."""
