import sys

from lora_demo.demo import main

sys.exit(main())
