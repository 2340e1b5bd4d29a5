"""SEAgent (self-evolving computer-use agent): the World State Model judge, step labels and step rewards."""
