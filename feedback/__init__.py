"""Feedback: message schemas, Kafka plumbing, SQL models and migrations, sink and rewards."""
