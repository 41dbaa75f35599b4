"""Math answers checked with math-verify.

``math_reward(completion, answer)`` takes the last ``\\boxed{...}`` of the completion, or,
without one, its last number, and asks math-verify whether it equals the reference
answer (so ``0.5``, ``1/2`` and ``\\frac{1}{2}`` all match). 1.0 if equal, else 0.0.
"""

from __future__ import annotations

import re

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        # "\boxed 5" form
        m = re.match(r"\\(?:boxed|fbox)\s+([^\s$]+)", text[start:])
        return m.group(1) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # unbalanced: the completion was cut off inside the box


def last_number(text: str) -> str | None:
    """The last number in the text (``-3``, ``1,234``, ``2.5``, ``3/4``), commas removed."""
    matches = _NUMBER_RE.findall(text)
    return matches[-1].replace(",", "") if matches else None


def extract_answer(completion: str) -> str | None:
    """The boxed answer if there is one, else the last number."""
    boxed = last_boxed(completion)
    return boxed if boxed is not None else last_number(completion)


def math_equal(predicted: str, reference: str) -> bool:
    """math-verify equivalence; falls back to exact string match if it cannot parse."""
    from math_verify import parse, verify

    gold = parse(f"${reference}$") or parse(reference)
    pred = parse(f"${predicted}$") or parse(predicted)
    if gold and pred:
        return bool(verify(gold, pred))
    return predicted.strip() == reference.strip()


def reference_answer(answer: str | float | int) -> str:
    """The reference as a bare answer: GSM8K's ``"...reasoning #### 42"`` becomes ``"42"``."""
    text = str(answer)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return text.strip().replace(",", "") if _NUMBER_RE.fullmatch(text.strip()) else text.strip()


def math_reward(completion: str, answer: str | float | int) -> float:
    """1.0 if the completion's extracted answer equals ``answer`` (math-verify), else 0.0.

    ``answer`` may be a bare answer (``"42"``, ``"\\frac{1}{2}"``) or GSM8K-style text ending
    in ``#### 42``.
    """
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    return 1.0 if math_equal(predicted, reference_answer(answer)) else 0.0
