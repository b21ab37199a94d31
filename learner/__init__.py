"""Learner: the MoE model, tokenizer, FP4 codecs, pretraining, RL losses and the weight store."""
