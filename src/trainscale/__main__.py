from trainscale.cli import run

run()
