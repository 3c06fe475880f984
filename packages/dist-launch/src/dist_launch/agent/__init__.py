"""This node's agent: it joins the rendezvous, runs each round's workers, and reports the end."""
