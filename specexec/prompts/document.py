"""The built-in long document (long_document.txt): a shared prefix for `specexec bench --context`, so the cost
of context can be measured on any model without a download.

The text is a synthetic technical handbook of a fictional tidal power station, composed by `compose()` from
this module's own sentence templates and word lists with a fixed seed: ours, free to ship, deterministic
(tests check the shipped file equals compose()), and varied enough that a model reads it as prose. About
200 KB, some 45,000 tokens for a typical BPE tokenizer.

Does not know: tokenizers or contexts (the bench cuts it to size).
"""
from __future__ import annotations

import random
from importlib import resources

FILE = "long_document.txt"
SEED = 19
SECTIONS = 90

SYSTEMS = ["intake gate", "turbine hall", "sluice array", "cooling loop", "tide gauge network", "sea wall",
           "control room", "switchyard", "fish ladder", "sediment flush", "backup generator", "pump station",
           "mooring line", "lock chamber", "signal mast", "data archive", "inspection crane", "valve gallery",
           "drainage tunnel", "weather station"]
PARTS = ["bearing", "seal", "shaft", "coupling", "sensor", "relay", "gasket", "actuator", "filter", "blade",
         "hinge", "cable tray", "pressure line", "level switch", "encoder", "brake pad", "hydraulic ram",
         "thrust collar", "inverter", "junction box"]
ROLES = ["the duty engineer", "the shift supervisor", "the harbour master", "the maintenance crew",
         "the control operator", "the safety officer", "the night watch", "the diving team",
         "the electrical foreman", "the environmental warden"]
VERBS = ["inspect", "clean", "calibrate", "lubricate", "tighten", "replace", "log", "test", "isolate", "flush"]
ADJ = ["worn", "loose", "noisy", "corroded", "warm", "damp", "misaligned", "stiff", "cracked", "clogged"]
WEATHER = ["a spring tide", "a neap tide", "an easterly gale", "dense fog", "a storm surge", "heavy rain",
           "a cold snap", "a calm night", "a heat wave", "a king tide"]
UNITS = [("flow", "cubic metres per second"), ("head", "metres"), ("speed", "revolutions per minute"),
         ("temperature", "degrees Celsius"), ("pressure", "bar"), ("current", "amperes"),
         ("vibration", "millimetres per second"), ("salinity", "grams per litre")]

TEMPLATES = [
    "Before each {weather}, {role} must {verb} every {part} of the {system} and note the result in the log.",
    "A {adj} {part} in the {system} is the most common cause of an unplanned stop; {role} should {verb} it at once.",
    "The {system} runs at a nominal {qty} of {n} {unit}, and an alarm is raised when it leaves the band of {lo} "
    "to {hi} {unit}.",
    "If the {qty} of the {system} rises above {hi} {unit} for more than {m} minutes, {role} opens the bypass and "
    "reports to the control room.",
    "Records show that {k} of the last {total} faults in the {system} began with a {adj} {part}.",
    "During {weather} the {system} is kept on manual control, and {role} checks it every {m} minutes.",
    "No one may {verb} a {part} of the {system} alone; {role} signs the permit and a second person stays within "
    "sight.",
    "The spare {part} for the {system} is stored in bay {bay}, shelf {shelf}, and the stock is counted on the first "
    "Monday of each month.",
    "When the {system} is restarted after maintenance, its {qty} is raised in steps of {step} {unit}, waiting "
    "{m} minutes between steps.",
    "The {system} was rebuilt in year {year} of operation, when the old {part} was replaced by a sealed design.",
    "A {adj} sound from the {system} usually means a {part} needs attention before the next {weather}.",
    "The handbook asks {role} to {verb} the {part}, to photograph it, and to file the photograph with the work "
    "order.",
    "Readings from the {system} are sampled every {s} seconds and averaged over {m} minutes before they are stored.",
    "Since the {system} shares a power feed with the {system2}, a fault in one is checked against the other.",
    "In the drill held each quarter, {role} practises isolating the {system} within {m} minutes.",
    "Experience has taught the crew to {verb} the {part} of the {system} before the season of {weather}.",
    "The limit of {hi} {unit} for the {system} was chosen with a margin of {pct} percent below the design value.",
    "A work order for the {system} lists the {part}, the tools, the permit number and the expected duration of "
    "{h} hours.",
    "Trainees spend their {ord} week with {role}, learning to {verb} each {part} of the {system}.",
    "The {system} can be bypassed through the {system2}, but only while the {qty} stays below {lo} {unit}.",
]
HEADINGS = ["Purpose", "Normal operation", "Inspection", "Faults and their causes", "Restart procedure",
            "Spare parts", "Safety", "Records", "Training", "Seasonal work"]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth"]


def _sentence(rng: random.Random, focus: str) -> str:
    """One sentence, about the section's system `focus` most of the time."""
    qty, unit = rng.choice(UNITS)
    n = rng.randint(20, 900)
    system, system2 = rng.sample(SYSTEMS, 2)
    if rng.random() < 0.7:
        system, system2 = focus, (system2 if system2 != focus else system)
    total = rng.randint(8, 60)
    return rng.choice(TEMPLATES).format(
        weather=rng.choice(WEATHER), role=rng.choice(ROLES), verb=rng.choice(VERBS), part=rng.choice(PARTS),
        system=system, system2=system2, adj=rng.choice(ADJ), qty=qty, unit=unit, n=n, lo=n - rng.randint(5, 19),
        hi=n + rng.randint(5, 19), m=rng.randint(2, 45), k=rng.randint(2, total - 1), total=total,
        bay=rng.randint(1, 24), shelf="ABCDEFGH"[rng.randint(0, 7)], step=rng.randint(1, 9),
        year=rng.randint(2, 30), s=rng.choice([1, 2, 5, 10, 15, 30]), pct=rng.randint(5, 25),
        h=rng.randint(1, 12), ord=rng.choice(ORDINALS))


def compose(seed: int = SEED, sections: int = SECTIONS) -> str:
    """The handbook: a title, then `sections` numbered sections of several paragraphs each."""
    rng = random.Random(seed)
    out = ["Operations Handbook of the Saltmarsh Tidal Power Station", "",
           "This handbook describes how the station is run, inspected and repaired. It is written for the "
           "people who keep it working, and it is revised after every season.", ""]
    for i in range(1, sections + 1):
        system = SYSTEMS[(i - 1) % len(SYSTEMS)]
        out += [f"{i}. The {system}: {HEADINGS[(i - 1) // len(SYSTEMS) % len(HEADINGS)].lower()}", ""]
        for _ in range(rng.randint(3, 5)):
            out += [" ".join(_sentence(rng, system) for _ in range(rng.randint(3, 6))), ""]
    return "\n".join(out)


def long_document() -> str:
    """The shipped document (long_document.txt)."""
    return resources.files(__package__).joinpath(FILE).read_text(encoding="utf-8")
