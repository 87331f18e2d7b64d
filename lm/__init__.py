"""Code both the rollout side and the learner side need: loading a causal LM and its tokenizer,
token log-probs, and the weight-publication payloads. Imports nothing else from etarl, so the
package arrows stay one way (rollout_workers -> lm <- learner)."""
