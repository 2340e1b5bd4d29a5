"""SGCD (skill-guided continuation distillation): skills, the desk's offline extractor, judges, the Continuation Success Rate."""
