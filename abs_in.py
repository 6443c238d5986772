import socket
for n in ["\0review-abs"]:
    try: s=socket.socket(socket.AF_UNIX); s.connect(n); print("abstract CONNECTED")
    except OSError as e: print("abstract", e)
import os
for p in ["/run/orchard","/tmp/review-agent-1","/run","/var/run/munge"]:
    print(p, os.path.exists(p), os.listdir(p) if os.path.isdir(p) else "")
