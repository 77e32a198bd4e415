"""The `gpufrac` command line.

commands  argument parsing and dispatch (each subcommand's module imported when it runs)
gpus      `gpufrac gpus` and `gpufrac topo`
status    `gpufrac status`
memguard  `gpufrac memguard inspect`
"""
