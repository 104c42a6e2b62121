"""Generation: token sampling, how long a generation may run, the vLLM engine (colocated), its
server and the weight channel to it."""
