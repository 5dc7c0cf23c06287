"""Test scaffolding shared by test modules: simulated links, fake process groups, CLI helpers."""
