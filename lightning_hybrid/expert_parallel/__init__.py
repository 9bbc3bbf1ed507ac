"""Expert parallelism: the experts of every mixture-of-experts layer split over the ranks of an ``ep`` group, tokens
sent to the rank holding their chosen expert and the results returned (all-to-all), for unmodified MoE code."""
