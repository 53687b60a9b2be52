"""Commands for users and maintainers that are not jobs: tiny pretrained folders
(`python -m tools.make_tiny_pretrained DIR`) and the config reference (`python -m
tools.config_reference`)."""
