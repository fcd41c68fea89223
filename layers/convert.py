from dataclasses import dataclass
@dataclass
class SwapRecord: pass
def convert(): pass
