"""Math answer verification: the RL reward of GRAFT (README "The method, equation by equation").

What it does
------------
Takes a model response and a gold answer (both untrusted strings), finds the response's final
answer and decides whether it is mathematically the same as the gold. Used for the training reward
(strict: only a ``\\boxed{...}`` answer counts) and for evaluation (same call, same verdicts).

Public API
----------
``extract_answer(text, *, strict=False, last_number=True) -> str | None``
    The response's answer, decided from the response alone (the gold is never looked at): cut at its first end-of-turn
    marker, nothing inside ``<think>`` (departure 24), nothing hidden. Then the last ``\\boxed{...}`` /
    ``\\fbox{...}``, joined with the boxes just before it when only ``,`` / ``and`` / ``x =`` separate them (departure
    16), under the strictness rule below (the tail rule); an unclosed or refused last box is no answer.
    ``strict=True`` (training) is boxed only. With ``strict=False`` a response without a box falls back to
    ``<answer>..</answer>``, the math after the last answer cue ("answer is", "Answer:", "####", ``所以``, Minerva's
    "The final answer is $X$. I hope it is correct."), the last math span, then (``last_number=True``) the last number
    with its unit word.
``is_equivalent(pred, gold, *, rel_tol=DEFAULT_REL_TOL) -> bool``
    Compares two answer strings (see "How answers are compared" below). Either may be wrapped in math delimiters or a
    box, and the gold may be a whole worked solution: its last box is the answer. A sentence (words around the math,
    ``Thus $x \\ge 5$ is the solution.``) is read like a response: its answer is what ``extract_answer(..,
    last_number=False)`` finds (never just its last number: ``cos(t)+sin(t)^2`` is not a sentence whose answer is 2).
``verify(response, gold, *, strict=True, rel_tol=DEFAULT_REL_TOL) -> float``
    1.0 or 0.0. Never raises. Anything over a cap scores 0.0 and is counted.
``verify_batch(responses, golds, *, workers=0, strict=True, rel_tol=...) -> list[float]``
    Order kept. ``workers`` 0 or 1 = in this process; > 1 = a "spawn" process pool (safe after CUDA/torch
    initialisation, unlike fork), created and shut down within the call (about a second of start-up, so it pays off
    from a few thousand responses). As with any spawn pool, the calling script needs the usual ``if __name__ ==
    "__main__":`` guard. If the pool fails, the remaining items are scored in-process.
``box_refused(text) -> bool``
    A box is written but no answer is read from it (a reading rule refused it, not its value).
``last_boxed(text) -> str | None``
    Content of the last outermost box of text, brace-matched, or None: the reader of golds (data/prepare.py takes a
    worked solution's answer with it).
``stats() -> dict`` / ``reset_stats()``
    Module-level counters (calls, limit hits, parse failures, internal errors). The only global state in this file.
    ``verify_batch`` adds its workers' counters to the caller's.
``DEFAULT_REL_TOL`` (1e-4, MATH-style golds) and ``MINERVA_REL_TOL`` (1e-2: Minerva golds are
    rounded to about three significant figures, which is up to 0.5% off the exact value).

How answers are compared
------------------------
1. Both strings are cleaned (spacing macros, ``\\left``/``\\right``, ``\\mathrm``-style font wrappers, ``$``, ``\\$``,
   degrees, thousands separators, trailing ``\\text{units}``), then parsed by the recursive-descent parser below into
   sympy objects, built directly (``Integer``, ``Rational``, ``Symbol``, ``Add``, ``Mul``, ``Pow``, ``sin`` ... with
   ``evaluate=False``), wrapped in small structure nodes: tuples/intervals (bracket kinds kept), sets, bare lists,
   unions, matrices, equations, plain text, multiple-choice letters.
2. Two expressions are equal when they agree at a few seeded pseudo-random rational points for their free symbols (one
   "point" when there are none). Evaluation is our own walk over the sympy tree: exact ``fractions.Fraction``
   arithmetic while only + - * / and integer powers appear, otherwise mpmath at 50 digits. Exact vs exact: identical
   Fractions, or agreement to 1e-44 relative plus the rounding that cancellation can leave (``NOISE`` times the
   largest term summed or angle of a periodic function): ``\\sin \\pi`` is 0, ``e^{-1000}`` and ``\\sqrt{10^{40}+1} -
   10^{20}`` are not. When either side contains a decimal literal: relative tolerance ``rel_tol``. sympy's
   ``simplify`` is never called, and the cost of each evaluation is bounded by the caps.
3. Undefined values (0/0, division by zero, nan, zoo) make the answer unequal to everything.

What counts as an answer (the strictness rule)
----------------------------------------------
Under RL the verifier is the objective: a form that scores 1 without being the answer is trained in. So the reward
fails closed. The principle: every leniency is a whitelist; what this file does not fully understand pays 0, so the
next unseen hack is refused by rule, not by a new word list.

One answer, one reward: the response's answer is decided from the response alone (``extract_answer``), then compared
(``is_equivalent``), so a hedge (``\\boxed{2} \\boxed{4}``, "I tried \\boxed{2}; no, it is \\boxed{9}") is paid for
its last answer only. The one dual reading kept is percent (departure 4). test_verify.py checks it over every case
file against every box, join, math span and number in it.

- Position (the tail rule, ``_tail_agrees``): the final box is the answer and prose after it is allowed (words, notes,
  figure code, a made-up next turn, which ends the response): one answer is read without the gold, so words cannot buy
  a second value. What follows may not continue the value (a digit, ``.5``, ``\\,000``, an operator with its operand,
  a power, ``!``, a scale or bound word, logic) nor state another final answer that differs from it (a whitelist of
  answer cues, ``_CUE_RE``; a restatement joined to the box: ``, i.e.``, ``=``, ``or``); the same value restated pays.
  A unit after the box the parser reads joins the answer (``_unit_after``).
- Before the box: an operand (``-\\boxed{7}``, ``\\frac{\\boxed{7}}{2}``, ``\\ne \\boxed{7}``), hidden content
  (``\\phantom``, ``~~struck~~``, a comment), a logic operator and an unclosed box make no answer; words do not.
- Value (``_same_marks``, ``_val_equal``): a unit, scale word or macro the unit table does not know makes the answer
  unequal to any gold without the same text (``12 \\text{ MHz}`` is not ``12 \\text{ Hz}`` nor 12); known units are
  dropped only against none or the same one (``5 km`` is not ``5 m``); percent is read both ways only when exactly one
  side has it; a degree sign never vanishes against a gold in radians; an exact decimal gold is met exactly by a
  rational answer (``0.50004`` is not ``0.5``); two congruences keep their moduli; expressions must also agree at wide
  points of both signs (``\\min(x, 1000)`` is not x).
- Not answers, unequal to every gold (``_check_math``, ``_check_product``, ``_same_marks``): program syntax (quotes,
  backticks, ``==``, ``?``, ``@``, ``#``, dotted names, ``import`` / ``lambda``; only ``np.`` / ``math.`` before a
  known function is dropped), a call of an unknown name (``print(4)``), a literal ``0`` factor beside a non-number
  (``k0``, ``0x``), qualifying words in a box's text (``12 \\text{ or thirteen}``, ``\\text{about } 12``), false
  chains (``x = 2+2 = 5``, an approximation of no one value), open lists, numbers side by side (``7 0``), a choice
  letter followed by anything but its value.
- Without a box (``strict=False``, evaluation only): the answer cue's math under the tail rule and the sentence rule
  (``_asserted``); the last math span or the last number under the sentence rule.

``data/verify_hacking.jsonl``, ``verify_rl.jsonl``, ``verify_asserts.jsonl`` and ``verify_failclosed.jsonl``
hold the forms a policy could try, by kind, each with honest controls.

Where this departs from math-verify / common practice (numbered so that reviews can cite them)
--------------------------------------------------------------------------------------------------
1. No ``sympify``/``parse_expr``/``eval``: the parser is ours and smaller; an answer it cannot parse is compared as
   normalised text only (so exotic LaTeX can give false negatives, never code runs). (``_Parser``, ``_parse``)
2. Symbolic equality is decided by evaluation at seeded rational points (Schwartz-Zippel style), not by ``simplify``:
   positive points first, then points of both signs at which neither side leaves the real numbers (a square root or
   logarithm of a negative value, found as a complex value from real arguments, skips the point). So ``\\sqrt{x^2}``
   is ``|x|`` and not ``x``, while ``\\ln(x^2)`` and ``2 \\ln x`` (equal where both are real) stay equal; then at wide
   points (about +-0.003 and +-4,000 to 80,000), so ``\\min(x, 1000)`` is not x. Equations are solution sets: compared
   at points of both signs and two far points (about 97 and -89 times the first), so ``y = \\sqrt{x^2}`` is not ``y =
   x`` and ``|x - 10| = 3`` is not ``x = 7``. (``_val_equal``, ``_agree``, ``_agree_signed``, ``_points``,
   ``_wide_points``, ``_eqn_equal``)
3. An exact decimal gold (``0.5``) is met exactly by a rational answer. Decimals vs other exact values: equal within
   ``rel_tol`` (default 1e-4) AND, when one side is a lone decimal and the other exact, the decimal must be the exact
   value rounded to the decimal's own digits. So ``0.8333`` equals ``\\frac56``, but ``0.333`` does not equal
   ``\\frac13`` (too far for rel_tol; math-verify accepts it) and ``100.01`` does not equal ``100`` (within rel_tol
   but not a rounding of 100). An expression with decimal terms against an exact value differs from it when the two
   are half its smallest decimal literal or more apart: an explicit term is part of the number (``12 + 0.00001`` is
   not 12, ``3.1416 r^2`` stays ``\\pi r^2`` within rel_tol). Pass ``MINERVA_REL_TOL`` for Minerva's
   three-significant-figure golds: a ``rel_tol`` above 1e-3 treats integers as rounded too (``901.8`` equals ``900``)
   and drops both checks. (``_agree``, ``_close``)
4. Percent: ``10\\%`` equals ``10`` and ``0.1`` (either reading is accepted) when the other side has no percent: the
   one dual reading kept, the one named exception to "one answer, one reward". (``_val_equal``)
5. Degrees: ``^\\circ`` is dropped, so ``30^\\circ`` equals ``30`` but not ``\\frac{\\pi}{6}``; never against a gold
   in radians (``\\frac{\\pi}{6}^\\circ`` is not ``\\frac{\\pi}{6}``). (``_clean (_DEGREE_RE)``, ``_same_marks``)
6. Numbers with a base subscript (``52_8``) compare by their digits: ``52_8`` equals ``52``.
   (``_Parser.parse_postfix``)
7. A bare comma list (``1, -2``) is unordered; a parenthesised tuple is ordered; a bare list equals a tuple with the
   same order. Bracket kinds of intervals must match (``[a,b)`` != ``(a,b)``). A column or row vector (``pmatrix``)
   equals a tuple with the same entries. A tuple of tuples against a bare list of tuples is unordered
   (``((1,2),(3,4))`` equals ``(3,4), (1,2)``). (``_equal``, ``_unordered_equal``, ``_ordered_equal``)
8. ``a \\pm b`` is the unordered pair ``{a+b, a-b}``. (``_expand_pm``)
9. ``x = 5`` equals ``5`` when the left side is a single symbol; two equations are equal when ``lhs - rhs`` of one is
   a non-zero constant multiple of the other's, or (several variables) when at sampled values of the others both are
   polynomials of degree <= ``MAX_ROOT_DEGREE`` in the last variable with the same real roots: ``x^3 = y^3`` equals
   ``x = y``, ``x^2 = y^2`` does not. (``_readings``, ``_eqn_equal``, ``_same_real_roots``)
10. ``e`` is Euler's number and ``i`` the imaginary unit everywhere. A run of three or more letters that is not a
    known function (``east``, ``SRMC``) is one symbol (or plain text when alone); one or two letters are a product of
    single-letter symbols. When the other answer uses all the letters of such a word as single symbols, the word is
    also read as their product (``abc`` equals ``ab \\cdot c``). (``_Parser.parse_letters``, ``_word_products``)
11. A number directly followed by an integer ``\\frac`` is a mixed number (``1\\frac{4}{5}`` = 9/5).
    (``_Parser._try_mixed``)
12. Trailing ``\\text{...}``/``\\mbox{...}`` after a value is a unit and is dropped when its words are in the unit
    tables (or the gold carries the same text); as a last try a known plain unit word (``cm``, ``inches``, ``m`` ...)
    after a number is dropped too. (``_clean``, ``_unit_of``, ``_strip_plain_unit``)
13. Unlike TeX, ``\\sqrt12`` (and ``√12``) is the root of 12; ``\\frac43`` stays 4/3 as in TeX. (``_clean``)
14. ``f(x) = ...`` and ``f(2) = ...`` as a whole answer are compared by the right side; ``0.\\overline{3}`` is 1/3.
    (``_clean``, ``_repeating_to_frac``)
15. Caps (input length, nesting depth, exponent and number size, evaluation steps, wall time per call) make a call
    return "not equivalent" instead of working longer; hits are counted. (``_Budget``, ``_tiny_check``)
16. Several boxes are one answer (a list) when only ``,``, ``;``, ``and``, ``or``, ``\\quad`` or a name ``y =`` stand
    between them: ``\\boxed{2}, \\boxed{5}`` equals ``2, 5`` and ``\\{2,5\\}`` but not ``5``. Boxes with other text
    between them are separate: the last one is the answer, whatever the gold (``$\\boxed{3}$ and, checking, also
    $\\boxed{-3}$`` is -3, never ``3, -3``), and a list is never matched by a suffix of it. A box repeated, or written
    again as the same value, is one; more than 16 joined boxes are no answer. (``_final_group``, ``_is_join_gap``,
    ``_is_operand``)
17. Named answers and chains (the prediction side only): a left side made of symbols and no number (``x``, ``AB``,
    ``|PQ|``, ``x+y``, ``A:B``, ``P(A)``) names the answer, so ``|PQ| = 6`` equals ``6`` and ``(a,b) = (4,1)`` equals
    ``(4,1)``; ``2x = 10`` is an equation, not 10. In ``t = 2+3+4 = 9`` the last value is the answer (``= 10`` at the
    end is wrong whatever came before; constants in the chain must equal it: ``2 + 2 = 5`` states nothing). Before the
    first ``\\approx`` is the exact value (``\\frac17 \\approx 0.14`` equals ``\\frac17``, not the gold ``0.14``); the
    approximation after it counts only when the exact part is a name (``t \\approx 9``). When the gold names its
    answer too, names must match (``x = 5`` is not ``y = 5``), and a chain that names the same variable states its
    value (``x = 5+5+1 = 11`` equals ``x = 11``). Assignments compared with a tuple are put in the order of their
    names (``b = 2, a = 1`` equals ``(1, 2)``). A ratio ``3:5`` is the number 3/5; a ratio of three (``1:2:3``) and a
    clock time (``05:00``) are compared as text (``V_1 : V_2 = 3 : 11`` equals the text ``3:11``). Assignments whose
    names repeat in a cycle are tuples (``a=3, b=1; a=5, b=1`` equals ``(3,1), (5,1)``); a labelled gold (``PQ = 6, RS
    = 2``) equals its values (``6, 2``) when the prediction states no relation. When the left side of an equality does
    not parse (a limit, an integral), the value after the last ``=`` counts when every side after the unparsed one is
    that same constant. (``_readings``, ``_chain_value``, ``_chain_holds``, ``_named_values``, ``_as_assignment``)
18. Inequalities, intervals and unions are compared as sets of real numbers: a relation in one variable that is linear
    in it or in its absolute value is solved (``-y > -2`` is ``y < 2``, ``2 \\le |w| \\le 3`` is ``[-3,-2] \\cup
    [2,3]``); chains are intersections; ``or`` between relations is a union and ``and`` an intersection; ``x \\ne 0``
    is two intervals; touching intervals merge. A bare ``(a, b)`` is read as an interval only against an inequality or
    a union. Two relations in different variables are never equal. Nonlinear relations are not solved, and a comma
    list of relations is not a set (``x < 1, x > 2`` means "or", ``x \\ne 1, x \\ne 2`` "and"). ``\\mathbb{R}
    \\setminus \\{a\\}``, ``[0,3] \\setminus (1,2)`` and ``\\{x \\mid x > a\\}`` are sets too, and brackets around a
    relation go (``(x < 1) \\text{ or } (x > 3)``); a union of finite sets is one set (``\\{1,2\\} \\cup \\{3\\}``
    equals ``\\{1,2,3\\}``). Against a relation, ``t = 2`` (one variable, linear) and a finite set of numbers are sets
    of points (``[0,2] \\cap [2,5]`` equals ``\\{2\\}``); a product of symbols bounded by constants is one variable
    (``(0, 2)`` equals ``0 < g(x) < 2``). Relations in several variables are equal when ``lhs - rhs`` of one is a
    constant multiple of the other's, positive for an inequality (``4y < 8a`` is ``y - 2a < 0``). Sets ignore repeats
    (``\\{3, 5, 3\\}`` equals ``\\{3, 5\\}``). (``_real_set``, ``_solve``, ``_sets_equal``)
19. A decimal comma is read as a decimal point only where it cannot be a thousands separator and the other side is a
    single number: ``3,25`` and ``0,125`` are decimals, ``1,250`` stays 1250; in the gold only against a decimal
    written with a point (``3.25`` equals a gold ``3,25``, ``325`` does not). Thousands separators also go before a
    unit or after a currency word (``1,250.50 EUR``, ``USD 1,250``). ``15 percent`` and ``15 pct`` are ``15\\%``;
    ``€``, ``£``, ``¥`` are dropped like ``\\$``; a tail of unit words (``m/s^2``, ``m²``, ``km/h``, ``USD``, also
    count nouns such as ``integers``, ``marbles``) after a number is dropped on the last try (departure 12). A whole
    answer ``5^{\\text{th}}`` / ``21st`` is the number; ``\\langle 1, 2 \\rangle`` is the tuple ``(1, 2)``.
    (``_decimal_comma_equal``)
20. Degrees inside a trigonometric function are converted to radians (``\\sin 30^\\circ`` equals ``\\frac12``,
    ``\\cot(90^\\circ - x)`` equals ``\\tan x``); elsewhere departure 5 holds. ``{2, 7}`` with plain braces is a set,
    ``;`` separates list and tuple items, ``\\emptyset`` is the empty set and ``\\mathbb{R}`` is ``(-\\infty,
    \\infty)``. ``\\sin^{-1}`` is arcsin (``\\sin(x)^2`` is ``\\sin^2 x``). A list of rows ``[[1, 2], [3, 4]]`` equals
    the matrix with those rows. (``_Parser.parse_function``)
21. Named functions: ``\\gcd`` / ``\\operatorname{lcm}`` of integers, ``\\max`` / ``\\min`` of real numbers, ``a
    \\bmod b`` (and ``a mod b``) of integers (``-3 \\bmod 4`` is 1); ``f(0)``, ``I(2)`` (one letter before a
    parenthesised integer) are one symbol, the function's value, not ``f`` times 0; ``\\pmod{m}`` is dropped, so ``x
    \\equiv 2 \\pmod 7`` equals ``2`` (the residue as written, not any number congruent to it), but two congruences
    must have the same modulus. ``\\lg`` is the base-10 logarithm, ``cosec`` is ``\\csc``. ``C(n, k)`` with integer
    literals ``n >= k`` is ``\\binom{n}{k}``, so a point named C with such coordinates would be read as a number.
    (``_ev_gcd``, ``_ev_extreme``, ``_clean (_PMOD_RE)``)
22. ``m!`` and ``\\binom{m}{k}`` of a symbol are evaluated through the Gamma function at its sample points, so ``m
    (m-1)!`` equals ``m!`` and ``\\binom{m}{2}`` equals ``\\frac{m(m-1)}{2}``. ``\\sum`` / ``\\prod`` with integer
    bounds are expanded when evaluated (up to ``MAX_SUM_TERMS`` terms); the body is the next term. With a symbolic
    bound (``\\sum_{j=1}^{m} j``) the names in the bounds are compared at the integers 2, 3, 5, 7, 11, 13 (the other
    names at rational points), so a sum equals its closed form (``\\frac{m(m+1)}{2}``) and not a near miss
    (``\\frac{m(m-1)}{2}``). A prediction's bound counts only for a name it uses nowhere outside its sums, so a sum
    cannot make a real variable an integer (``\\sum_{j=1}^{x} 0 + \\lfloor x \\rfloor`` is not ``x``). (``_gamma_of``,
    ``_ev_big_operator``, ``_bound_names``)
23. Matrices: entrywise sums and differences, scalar multiples, negation and ``^T`` are computed; matrix products are
    not parsed. ``\\begin{vmatrix}`` and ``\\det`` are the determinant (up to 4x4). (``_det``, ``_matrix_add``)
24. Whole responses: nothing inside ``<think>..</think>`` counts, after a ``</think>`` only what
    follows it, and an unclosed ``<think>`` hides the rest; R1's ``<answer>..</answer>`` is read
    (``strict=False``); ``所以``, ``因此``, ``答え``, ``答えは`` are cues too, and a Chinese or Japanese
    sentence after a cue gives its one number (none when it hedges: ``或``, ``不``, ``可能``); a whole
    response that is bare arithmetic (``4+7``) is its value; after an answer cue a sentence ``The
    smallest $k$ is 12.`` gives what follows its last "is"; ``答案``, ``答：``, ``Réponse :``,
    ``Respuesta:``, ``Antwort:``, ``Ответ:`` are answer cues. (``extract_answer``,
    ``_after_thinking``, ``_answer_tag``, ``_after_phrase``)
25. Implicit products: in a run of one or two letters every letter is a factor with its own postfix (``xy^2`` is ``x
    y^2``); outside an absolute value a ``|`` starts a factor (``|a||b|``, ``2|a|``). ``\\\\le`` (a doubled backslash,
    as JSON-escaped golds carry it) before a known command is ``\\le``. A list ending in ``\\ldots`` is compared as
    text only (never equal to a finite list). (``_Parser.parse_term``)
26. Answers as sympy prints them are rewritten as text into the forms above before parsing (nothing is evaluated):
    ``Interval.Ropen(0, 1)`` is ``[0, 1)``, ``FiniteSet(1, 2)``, ``EmptySet``, ``Reals``, ``Union(..)``, ``Eq(y,
    2*x)``, ``Rational(1, 3)``, ``Abs``, ``ceiling``, ``binomial``, ``factorial``, ``log(x, 2)``; ``oo`` is infinity
    and ``**`` a power. (``_sympy_printed``)
27. Notations of other scripts and typesetting, read before parsing: full-width and Arabic-Indic digits (``４５``,
    ``٤٥``), vulgar fractions (``⅞``, ``2½`` a mixed number), superscript digits (``10⁶``), the fraction slash
    (``1⁄2``), no-break and thin spaces as thousands separators, ``\\textcolor{..}{7}`` and ``\\color``, ``{3 \\over
    4}``, repeating decimals ``0.(3)``, the European ``3.400,25``, juxtaposed powers ``3^2 7^4``, ``7 + 0i``; ``x
    \\equiv 7 \\pmod 1`` states no residue, and a power below 1e-40 (``7 + e^{-200}``, ``7^{1+10^{-60}}``) or a root
    of an exact value within 1e-40 of a rational it is not (``\\sqrt{49 + 10^{-100}}``) is a limit hit, never 7. So is
    an exact value that carries more precision than 50 digits keep, where it meets an inexact one: an exact term below
    1e-40 of the sum it is in (``\\pi + 10^{-60}``), a value within 1e-40 of a simpler rational (``\\pi(1 +
    10^{-60})``) or an integer of more than 40 significant digits (``3^{100}\\pi``, so such a gold equals nothing: the
    named cost). Closeness is relative to the precision an expression carries, and an explicit tiny term is another
    number, never the same one within a tolerance. (``_fold_digits``, ``_clean``, ``_pow``, ``_carried``)

What it accepts (each row: a form and examples that parse; the departures above say how they compare)
------------------------------------------------------------------------------------------------------
==================  ================================================================================
numbers             ``42``, ``-0.5``, ``.5``, ``2,880``, ``2{,}880``, ``1 000``, ``3,25``, ``4.46e19``,
                    ``52_8``, ``0.\\overline{3}``, ``1\\frac45``, ``10\\%``, ``45 percent``, ``\\$18.90``,
                    ``6€``, ``21st``
arithmetic          ``+ - * / : \\cdot \\times \\div \\bmod``, implicit products ``2xy``, ``^``, ``**``,
                    ``!``, ``\\frac``, ``\\sqrt[n]``, ``\\binom``, ``{n \\choose k}``, ``C(6,2)``, ``|x|``,
                    ``\\lfloor \\rfloor``, ``\\lceil \\rceil``, ``\\pm``, ``\\sum_{k=1}^{4}``, ``\\prod_{i=1}^{3}``
functions           ``sin cos tan sec csc cot`` (``cosec``), their ``arc``/``^{-1}`` inverses,
                    ``sinh cosh tanh sech csch coth`` (``cosech``), inverses (``arcsinh``, ``arccot``),
                    ``exp ln log log_b lg sqrt abs floor ceil``,
                    ``gcd lcm max min det``; with a backslash, ``\\operatorname{..}`` or in ASCII
constants           ``\\pi``, ``e``, ``i``, ``\\infty``, ``\\mathbb{R}``, ``\\emptyset``
relations           ``= < > \\le \\ge \\ne`` and ``<= >= != \\leq \\geqslant \\lt \\gt \\not= \\equiv``,
                    chains, ``\\text{ and }`` / ``\\text{ or }``, ``x \\in [a, b]``, ``\\{x \\mid x > 0\\}``
structures          tuples ``(a, b)``, intervals ``[a, b)``, sets ``\\{..\\}`` / ``{..}``, bare lists
                    ``a, b``, ``\\cup \\cap \\setminus``, ``\\langle a, b \\rangle``, matrices ``pmatrix bmatrix matrix
                    array vmatrix`` and ``[[1, 2], [3, 4]]``, ``A + B``, ``2A``, ``A^T``
names               ``x = 5``, ``|PQ| = 6``, ``(a,b) = (4,1)``, ``f(2) = 9``, ``V_1 : V_2 = 3 : 11``,
                    ``a=3, b=1; a=5, b=1``, ``t = 2+3+4 = 9``, ``\\frac17 \\approx 0.14``
text                ``\\text{Evelyn}``, choices ``(C)`` / ``\\textbf{(C)}``, units ``5 \\text{ cm}``,
                    ``12 km/h``
sympy, wrappers     departure 26; ``\\boxed``, ``$..$``, ``\\(..\\)``, ``\\[..\\]``, answer cues (Public API)
==================  ================================================================================

Dependencies: sympy and the standard library (plus mpmath, which sympy itself requires).

Benchmark
---------
``python -m bench.verify`` (its docstring says what it prints): accuracy, false positives, hedges and speed on the
seven case files of ``data/``, with math-verify beside it on the same cases; ``python -m bench.verify golds`` checks
every benchmark gold against itself; ``python -m bench.verify against REF`` lists the verdicts that differ from
another copy of this file, with reasons."""
from __future__ import annotations

import math
import random
import re
import threading
import time
from dataclasses import dataclass, field
from fractions import Fraction

import mpmath
import sympy
from sympy import S

__all__ = [
    "extract_answer", "is_equivalent", "verify", "verify_batch", "box_refused", "last_boxed", "stats", "reset_stats",
    "DEFAULT_REL_TOL", "MINERVA_REL_TOL",
]

# ------------------------------------------------------------------------------------------------
# Caps and tolerances. Every call is bounded by these; going over one is a "limit hit": the answer
# counts as not equivalent and the counter goes up.

DEFAULT_REL_TOL = 1e-4      # decimals vs anything: relative tolerance (MATH golds are exact)
MINERVA_REL_TOL = 1e-2      # Minerva golds have ~3 significant figures (up to 0.5% rounding)
APPROX_GOLD_TOL = 1e-3      # rel_tol above this: golds are approximate, no rounding check
EXACT_REL_TOL = 1e-44       # exact vs exact evaluated at 50 digits (irrational functions): rounding only
ABS_TOL = 1e-40             # absorbs cancellation noise around zero at 50 digits (intervals, ratios)
NOISE = 1e-45               # expressions: rounding noise at 50 digits, relative to the largest term summed
MAX_RESPONSE_CHARS = 200_000  # longer responses: only the tail is searched for the answer
MAX_ANSWER_CHARS = 1_500    # an extracted answer longer than this is not parsed
MAX_DEPTH = 60              # nesting depth of the parse
MAX_NODES = 4_000           # parse atoms / evaluation steps per comparison
MAX_INT_DIGITS = 1_000      # digits of one numeric literal
MAX_EXACT_BITS = 200_000    # bigger exact intermediates switch to 50-digit floats
MAX_MAG_BITS = 100_000      # |value| above 2**this (about 1e30103) is a limit hit
MAX_POW_EXP = 10_000        # integer exponents computed exactly up to this size
MAX_FACTORIAL = 5_000       # exact n! up to this n (2004! appears in MATH golds)
MAX_GAMMA_ARG = 10_000      # x! of a non-integer x (a symbol's sample point) via Gamma up to this
MAX_SUM_TERMS = 1_000       # terms of one \sum / \prod with numeric bounds
MAX_DET_SIZE = 4            # \det of matrices up to this size (expanded by cofactors)
MAX_ROOT_DEGREE = 4         # equations as solution sets: polynomials up to this degree are solved
MAX_SECONDS = 0.5           # wall-clock backstop per comparison (checked, never signalled)
N_POINTS = 3                # evaluation points for expressions with free symbols
_DPS = 50

# A private mpmath context: its precision is set once here and never changed, so sharing it between
# threads is safe (the global mpmath.mp is mutable shared state).
_MP = mpmath.MPContext()
_MP.dps = _DPS
_MP_ROOTS = mpmath.MPContext()      # roots of polynomials of degree 3 and 4 (solution sets): 20 digits
_MP_ROOTS.dps = 20

# ------------------------------------------------------------------------------------------------
# Public API (the module docstring's contract). Everything below it serves these functions.

def verify(response: str, gold: str, *, strict: bool = True,
           rel_tol: float = DEFAULT_REL_TOL) -> float:
    """Reward of one response: 1.0 when its final answer equals gold, else 0.0."""
    try:
        pred = extract_answer(response, strict=strict)
        if pred is None or "\\boxed" in pred or "\\fbox" in pred:
            return 0.0          # no answer, or a box inside a box beside other content
        return 1.0 if is_equivalent(pred, gold, rel_tol=rel_tol) else 0.0
    except Exception:
        _count("errors")
        return 0.0


def verify_batch(responses: list, golds: list, *, workers: int = 0, strict: bool = True,
                 rel_tol: float = DEFAULT_REL_TOL) -> list[float]:
    """verify() over a batch, order kept. workers > 1 uses a spawn process pool for this call."""
    responses, golds = list(responses), list(golds)
    if len(responses) != len(golds):
        raise ValueError(f"verify_batch: {len(responses)} responses but {len(golds)} golds")
    if workers is None or workers <= 1 or len(responses) < 2:
        return [verify(r, g, strict=strict, rel_tol=rel_tol) for r, g in zip(responses, golds)]
    import concurrent.futures
    import multiprocessing
    n_chunks = min(len(responses), workers * 4)
    size = -(-len(responses) // n_chunks)
    chunks = [(responses[k:k + size], golds[k:k + size], strict, rel_tol)
              for k in range(0, len(responses), size)]
    ctx = multiprocessing.get_context("spawn")
    out: list[float] = []
    try:
        with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            for scores, delta in pool.map(_verify_chunk, chunks):
                out.extend(scores)
                for k, v in delta.items():
                    _count(k, v)
    except (OSError, RuntimeError, concurrent.futures.process.BrokenProcessPool):
        # A pool that cannot start or lost a worker must not cost the training step: score the
        # rest here (each call is bounded anyway).
        _count("errors")
        out.extend(verify(r, g, strict=strict, rel_tol=rel_tol)
                   for r, g in zip(responses[len(out):], golds[len(out):]))
    return out


def is_equivalent(pred: str, gold: str, *, rel_tol: float = DEFAULT_REL_TOL) -> bool:
    """True when the answer string pred means the same as gold. Never raises; caps give False."""
    _count("calls")
    if not isinstance(pred, str) or not isinstance(gold, str):
        return False
    try:
        return _compare(pred, gold, rel_tol)
    except _Limit:
        _count("limit_hits")
    except (_ParseError, _Undefined):
        _count("parse_failures")
    except _NotMath:
        _count("not_math")
    except RecursionError:
        _count("limit_hits")
    except Exception:           # a bug in this file must not crash a training step
        _count("errors")
    return False


def extract_answer(text: str, *, strict: bool = False, last_number: bool = True) -> str | None:
    """The final answer of a response (None when there is none): the module docstring's Public API and
    strictness rule say how it is read."""
    if not isinstance(text, str) or not text:
        return None
    if len(text) > MAX_RESPONSE_CHARS:
        text = text[-MAX_RESPONSE_CHARS:]
    text = _visible(_after_thinking(_end_of_turn(_fold_digits(text))))
    if not text.strip():
        return None
    boxes, found = _last_boxes(text), _outer_boxes(text)
    if boxes is not None or strict or found is None or found:
        return _join(boxes) if boxes else None      # an unclosed last box, or one that is no answer
    tag = _answer_tag(text)
    if tag is not None:     # R1's '<answer>15</answer>': the last tag's content is the answer
        return _tidy(tag) or None if _is_bare_answer(tag) else extract_answer(tag, last_number=last_number)
    tail = text[-4000:]     # fallbacks only look at the end, where conclusions are
    if len(text) < 200 and _BARE_ARITHMETIC_RE.match(text):
        return text.strip()   # a whole response '4+7' is its value 11, not its last number
    if _is_bare_answer(text):
        return _tidy(text)    # a whole response '\\{1, 3, 5, \\ldots\\}' or '3 or 4' is its answer
    for find in (_after_phrase, _last_math):
        ans = find(tail)
        if ans is not None:
            return ans or None      # '' : an answer cue followed by no answer ('答案不是45')
    if not last_number or _HEDGE_WORDS_RE.search(tail.strip().rsplit("\n", 1)[-1]):
        return None         # 'It is either 4 or 5.': a hedge, not an answer to read a number from
    last = None
    for last in _NUMBER_RE.finditer(tail):
        pass
    if last is None:
        return None
    num = last.group(0).rstrip(",")
    unit = re.match(r"\s*([A-Za-z]+)", tail[last.end():])
    if unit and unit.group(1) in _UNIT_DIMS and "," not in num:
        return f"{num} \\text{{ {unit.group(1)}}}"
    if num.count(",") > 1 and not re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", num):
        num = num.rsplit(",", 1)[1]     # '1,3,5' is a list whose last number is 5, not a number
    return num


def box_refused(text: str) -> bool:
    """A box is written but the trainer's reader (``extract_answer(strict=True)``) takes no answer from it: refused by
    a reading rule (a value continued, a second answer that differs, an unclosed box), not by its value."""
    boxed = isinstance(text, str) and ("\\boxed" in text or "\\fbox" in text)
    return boxed and extract_answer(text, strict=True) is None


def last_boxed(text: str) -> str | None:
    """Content of the last outermost \\boxed{...} / \\fbox{...} of text, brace-matched ('\\boxed 5' gives the next
    token); None when there is none or a box is unclosed. The reader of golds (data/prepare.py): unlike
    extract_answer it joins nothing, hides nothing and judges nothing."""
    if not isinstance(text, str):
        return None
    boxes = _outer_boxes(text)
    return boxes[-1][2] if boxes else None

def stats() -> dict:
    """A copy of the counters: calls, limit_hits, parse_failures, not_math (refused by the strictness rule), errors."""
    with _STATS_LOCK:
        return dict(_STATS)


def reset_stats() -> None:
    with _STATS_LOCK:
        for k in _STATS:
            _STATS[k] = 0


def _verify_chunk(args):
    responses, golds, strict, rel_tol = args
    before = stats()
    scores = [verify(r, g, strict=strict, rel_tol=rel_tol) for r, g in zip(responses, golds)]
    after = stats()
    return scores, {k: after[k] - before.get(k, 0) for k in after}


# ------------------------------------------------------------------------------------------------
# Counters (the only module-level mutable state).

_STATS_LOCK = threading.Lock()
_STATS = {"calls": 0, "limit_hits": 0, "parse_failures": 0, "not_math": 0, "errors": 0}


def _count(key: str, n: int = 1) -> None:
    with _STATS_LOCK:
        _STATS[key] = _STATS.get(key, 0) + n


class _Limit(Exception):
    """A cap was hit: the comparison is abandoned and scores 'not equivalent'."""


class _ParseError(Exception):
    """Our parser does not understand the answer; text comparison is used instead."""


class _Undefined(Exception):
    """The value is undefined (0/0, 1/0, nan): never equal to anything."""


class _NotMath(Exception):
    """The prediction is not a mathematical answer (the strictness rule): unequal to every gold."""


class _Budget:
    """Step counter plus a wall-clock backstop, shared by the parse and the evaluation of one call."""

    __slots__ = ("steps", "deadline", "left_reals", "scale")

    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.perf_counter() + MAX_SECONDS
        self.left_reals = False     # an evaluation went complex from real inputs (sqrt of a negative)
        self.scale = 0              # largest rounded term summed or angle of a periodic function

    def tick(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > MAX_NODES * 8:
            raise _Limit("too many steps")
        if self.steps & 63 == 0 and time.perf_counter() > self.deadline:
            raise _Limit("time")


# ------------------------------------------------------------------------------------------------
# Extraction

_BOX_CMDS = ("\\boxed", "\\fbox")
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
# Where a turn ends: chat-template markers; and (after an answer) a base model's next few-shot problem.
_TURN_END_RE = re.compile(r"<\|(?:im_end|im_start|eot_id|end_of_text|endoftext|start_header_id|end|user|"
                          r"assistant|eot)\|>|</s>|<end_of_turn>|<start_of_turn>|<eos>|\[INST\]")
_NEXT_PROBLEM_RE = re.compile(r"\n\s*(?:Problem|Question|Exercise|Q|User|Human|Assistant|###\s*(?:Instruction|"
                              r"Response)|(?:Now\s+(?:it\s+)?is\s+)?your\s+turn|(?:Here\s+is\s+)?a\s+new\s+(?:question|"
                              r"problem))\s*\d*\s*[:.!]", re.IGNORECASE)
# What may stand between two boxes (or two math spans) that together give one answer:
# "\boxed{2}, \boxed{5}", "$\boxed{1}$ and $\boxed{3}$", "x=\boxed{2}, y=\boxed{5}" (departure 16).
_JOIN_GAP_RE = re.compile(r"\s*[,;]?\s*(?:(?:and|or|\\text\s*\{\s*,?\s*(?:and|or)\s*,?\s*\}|\\quad|\\qquad)\s*){0,3}"
                          r"(?:[A-Za-z](?:_\{?\w{1,3}\}?)?\s*=\s*)?", re.IGNORECASE)
# "The final answer is $12$. I hope it is correct.", "Answer: 42", "**Answer:** $\frac38$", "#### 18".
_ANSWER_PHRASE_RE = re.compile(r"(?:answer\s*(?:is|:|=)|answer\s*\*\*\s*:?|answer\s*:?\s*\*\*|^\s*####|"
                               r"答案\s*(?:是|为|為)?\s*[:：]?|(?<!\S)答\s*[:：]|"
                               r"(?:réponse|respuesta|resposta|antwort|risposta|ответ|答え|정답)"
                               r"\s*[:：]|答え\s*は|"
                               r"(?:所以|因此|因而|综上所述|综上)\s*[,，:：]?)\s*:?",
                               re.IGNORECASE | re.MULTILINE)
_LEAD_CUE_RE = re.compile(r"^(?:\*\*)?(?:final\s+)?answer\s*(?:\*\*)?\s*[:：]?\s*(?:\*\*)?\s*(?=[$\\])",
                          re.IGNORECASE)
_IS_VALUE_RE = re.compile(r"\s(?:is|are|equals|was|=)\s+(?!\s)(.+)$")
_BARE_ARITHMETIC_RE = re.compile(r"^\s*[-+]?\d[\d\s.]*(?:[-+*/×·]\s*\(?\s*\d[\d\s.]*\)?\s*)+$")
_MATH_SPAN_RE = re.compile(r"\$\$(.+?)\$\$|\\\[(.+?)\\\]|\\\((.+?)\\\)|(?<!\\)\$(.+?)(?<!\\)\$", re.DOTALL)
_HEDGE_WORDS_RE = re.compile(r"(?<![A-Za-z])(?:or|not|maybe|perhaps|possibly|probably|either|might|guess|unsure|"
                             r"not sure|could be)(?![A-Za-z])", re.IGNORECASE)
_CJK_RE = re.compile(r"[\u3000-\u30ff\u4e00-\u9fff\uff00-\uffef]")
# Words of a Chinese or Japanese sentence that hedge, negate or bound its number ('or', 'maybe', 'not',
# 'about', 'at least' ...): such a sentence after an answer cue gives no answer.
_CJK_HEDGE_RE = re.compile(r"或|可能|大概|也许|不|约|左右|以上|以下|至少|至多|かも|ない|未満")
_MAX_JOIN = 16              # at most this many boxes / spans are joined into one answer
_MAX_GAP = 40               # characters between joined boxes / spans
_MAX_STATED = 8             # answer statements read after the final answer (each a comparison); more: no answer


def _match_brace(text: str, start: int) -> int:
    """Index of the '}' closing the '{' at text[start], or -1. Iterative: any depth is fine."""
    depth = 0
    i = start
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2          # an escaped brace \{ or \} does not count
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def _box_at(text: str, pos: int, cmd: str):
    """(end index, content) of the box command at text[pos]; "open" when its brace never closes;
    None when no argument follows."""
    i = pos + len(cmd)
    n = len(text)
    j = i
    while j < n and text[j] in " \t\n":
        j += 1
    if j < n and text[j] == "{":
        end = _match_brace(text, j)
        return "open" if end < 0 else (end + 1, text[j + 1:end])
    if j > i:               # "\boxed 5": the token up to whitespace or '$'
        m = re.match(r"[^\s$]+", text[j:])
        return (j + m.end(), m.group(0)) if m else None
    return None


def _outer_boxes(text: str) -> list | None:
    """(start, end, content) of the outermost boxes of text in order; None when one is unclosed."""
    starts = []
    for cmd in _BOX_CMDS:
        p = text.find(cmd)
        while p >= 0 and len(starts) < 10_000:
            if not text[p + len(cmd):p + len(cmd) + 1].isalpha():    # \boxed, not \boxedx
                starts.append((p, cmd))
            p = text.find(cmd, p + 1)
    starts.sort()
    boxes = []              # (start, end, content) of the outermost boxes, in order
    for p, cmd in starts:
        if boxes and p < boxes[-1][1]:
            continue        # a box inside the previous box
        got = _box_at(text, p, cmd)
        if got == "open":
            return None     # everything after it is inside the unclosed box
        if got is not None:
            boxes.append((p, got[0], got[1]))
    return boxes


def _last_boxes(text: str) -> list[str] | None:
    """Contents of the last box and of the boxes just before it that belong to the same answer.

    None when there is no box or the last one is unclosed (a truncated response has no answer)."""
    group = _final_group(text)
    if not group:
        return None
    contents = []
    for _, _, c in group:
        inner = _outer_boxes(c.strip()) if ("\\boxed" in c or "\\fbox" in c) and len(group) == 1 else None
        whole = inner is not None and len(inner) == 1 and inner[0][0] == 0 and inner[0][1] == len(c.strip())
        contents.extend(_last_boxes(c.strip()) or [] if whole else [c])     # \\boxed{\\boxed{7}} is 7
    if 1 < len(contents) <= 4 and len(set(contents)) > 1 and all(_same_value(c, contents[-1]) for c in contents):
        return contents[-1:]    # '\\boxed{15\\frac{39}{40}}, or \\boxed{\\frac{639}{40}}': one value written twice
    return contents


def _same_value(a: str, b: str) -> bool:
    """a and b are the same answer read either way round (False when either cannot be compared)."""
    try:
        return _compare(a, b, DEFAULT_REL_TOL) and _compare(b, a, DEFAULT_REL_TOL)
    except Exception:       # (_Limit, _ParseError, _NotMath ...): not shown to be the same
        return False


def _final_group(text: str) -> list | None:
    """(start, end, content) of the boxes that make the answer: the last box and the boxes joined to it (departure
    16), with a unit the parser reads. None when there is no box, the last one is unclosed, the group is an operand
    ('-\\boxed{7}', '\\lnot\\boxed{7}') or the tail rule refuses what follows it. The gold is never looked at."""
    boxes = _outer_boxes(text)
    if not boxes:
        return None
    out = [boxes[-1]]
    for b in reversed(boxes[:-1]):
        gap = text[b[1]:out[0][0]]
        if len(gap) > _MAX_GAP or not _is_join_gap(gap):
            break
        if len(out) >= _MAX_JOIN:
            return None     # more joined boxes than the cap: a suffix of them is no answer
        out.insert(0, b)
    unit_end, unit = _unit_after(text, out[-1][1]) if len(out) == 1 else (out[-1][1], "")
    if unit and _same_value(out[0][2] + unit, out[0][2]):   # '\\boxed{1.6} \\mathrm{~cm}': a unit the parser
        out = [(out[0][0], unit_end, out[0][2] + unit)]     # reads is part of the answer, compared as such;
    if any(_is_operand(text, a, b) for a, b, _ in out) or _logic_before(text, out[0][0]):  # one it cannot read
        return None                                                 # ('kcal m^{-2} yr^{-1}') is context
    return out if _tail_agrees(text[unit_end:], _join([c for _, _, c in out])) else None


# The tail rule (the module docstring's "Position"): the value continued (glued: a digit, a letter, '!', "'", '(', a
# power; across a delimiter: '.5', ',000', ' 15', an operator with its operand; a scale or bound word; logic).
_LOGIC_OPS = r"lor|vee|land|wedge|oplus|veebar|iff|Leftrightarrow"
_LOGIC_WORDS = r"(?<![A-Za-z\\])(?:xor|nor|nand|iff)(?![A-Za-z])"
_CONTINUES_RE = re.compile(
    r"(?:\d|[A-Za-z]|[!'_(]|\^(?!\s*\{?\s*\\prime)|\{\s*\}(?!\s*\^\s*\{?\s*\\circ)|"
    r"\\(?:frac|dfrac|tfrac|sqrt|binom)(?![A-Za-z]))|(?:\s*(?:\$|\\[)\]]))?(?:[.,]\d|(?:\\[,!; ]|\{,\}|[ \t])\d{3}"
    r"(?!\d)|[ \t]+\d|\s*(?:[-+*/×÷·]|\\(?:times|cdot|div|mp)(?![A-Za-z]))\s*(?:[\d(\\{]|[A-Za-z](?![A-Za-z]))|"
    r"\s*\\pm(?!\s*[\d.]+(?![\d.]*\s*[-+*/^\\]))|\s*(?:\\(?:text|mathrm|mbox)\s*\{\s*)?(?:thousand|million|billion|"
    r"trillion|hundred|dozen|lakh|crore|gross|score|myriad|squared|cubed|doubled|tripled|halved|factorial)s?"
    r"(?![A-Za-z])|\s*(?:or\s+(?:more|less|fewer|greater|higher|lower|above|below)|and\s+(?:up|above|below|over)|"
    r"at\s+(?:least|most)|(?:plus|minus|times)\s+\S)(?![A-Za-z])|"
    r"\s*(?:\$\s*)?(?:\\(?:" + _LOGIC_OPS + r"|lnot|neg)(?![A-Za-z])|[¬∨∧⊕⇔]|" + _LOGIC_WORDS + r"))",
    re.IGNORECASE)
_RESTATE_RE = re.compile(r"\s*(?:\$\$?|\\[)\]])?\s*(?:,\s*)?(?:\\(?:text|mbox|mathrm)\s*\{\s*)?(?:(?:i\.\s?e\.?|"
                         r"that\s+is(?:\s+to\s+say)?|in\s+other\s+words|namely|equivalently|or|and|"
                         r"which\s+(?:is|equals))(?![A-Za-z])[,:]?|或者?|"
                         r"\(\s*(?:i\.\s?e\.?|that\s+is|or)(?![A-Za-z])[,:]?|=>|=|\\to|->|\\(?:Rightarrow|implies)|"
                         r"[⇒→]|[,;](?=\s*(?:[-\d(]|\$\s*[-\d(\\]|\\[(\[])))", re.IGNORECASE)
# Answer statements, a whitelist: 'Answer:' / 'Final:' / 'Correction:' opening a line or sentence, 'the answer is'
# (was, should be..), 'final result is', '####', '答案', <answer>, other scripts'; not 'check our answer: ..'.
_OPENS = r"(?:^|(?<=[.!?;$)\]]))[ \t>#*]*"
_IS = r"\s*(?:\*\*|\})?\s*(?:is|was|(?:should|must|would|will)\s+be|becomes|:|：|=)"
_CUE_RE = re.compile(
    _OPENS + r"(?:\\textbf\s*\{)?(?:final\s+)?answer" + _IS + r"|(?:final|the|correct|right|true|actual|my)\s+answer" +
    _IS + r"|final\s+(?:answer\s*(?=[-$\\\d])|result" + _IS + r")|" + _OPENS + r"(?:ans\.?|final|result|correction|"
    r"erratum|revised|corrected|updated?)(?:\s+answer)?\s*[:：]|####|答案\s*(?:是|为|為)?|(?:réponse|respuesta|"
    r"resposta|antwort|risposta|ответ|答え|정답)\s*(?:[:：]|은|는|は|est|es|é|ist|è)|<answer>",
    re.I | re.M)
_STATED_RE = re.compile(r"(?:\\boxed|\\fbox|\$|\\[(\[]|-?\.?\d|\\(?:frac|dfrac|sqrt|pi|infty|text)(?![A-Za-z])|"
                        r"\(\s*[A-E]\s*\)|[A-E](?![A-Za-z'])|[-(\[{])")
_LEAD_RE = re.compile(r"(?:[A-Za-z']+\s+){0,4}?(?:is|are|was|equals|should\s+be|=)\s+")
_ADVERBS_RE = re.compile(r"(?:(?:actually|really|clearly|therefore|thus|hence|so|indeed|simply|just|then|now|"
                         r"definitely|instead|rather|in\s+fact|probably|likely|exactly|precisely)\b[\s,]*)+", re.I)
_CLAUSE_END_RE = re.compile(r"(?<!\d)\.(?!\d)|[;\n。]|,\s|\s+(?:since|because|as|so|for|when|where|if|from|by)\s")


def _lead_math(rest: str) -> tuple[int, int, str] | None:
    """(start, end, answer) of the math spans that open rest (after spacing, ':' and '*'), joined as one answer,
    with a known unit after them; None when rest does not open with math."""
    spans = _math_spans(rest)
    if not spans or rest[:spans[0][0]].strip(" \t\n:*"):
        return None
    joined = [spans[0]]
    for s in spans[1:]:
        if len(joined) >= _MAX_JOIN or not _is_join_gap(rest[joined[-1][1]:s[0]]):
            break
        joined.append(s)
    end, unit = _unit_after(rest, joined[-1][1]) if len(joined) == 1 else (joined[-1][1], "")
    return joined[0][0], end, _tidy(_join([_tidy(c) for _, _, c in joined]) + unit)


def _stated(rest: str, cue: bool = True) -> str | None:
    """The value an answer statement gives at the start of rest (after its cue, past adverbs and, after a cue, a
    lead-in: 'Erratum: it is 15'): a box, math spans, or a number or expression up to its clause's end; '' when
    hedged ('or maybe 8'); None for words ('so we are done', 'twelve', 'and the sum is 7' after a restatement)."""
    rest = rest[:600].lstrip(" \t*:：}")
    rest = rest[_ADVERBS_RE.match(rest).end():] if cue and _ADVERBS_RE.match(rest) else rest
    if not _STATED_RE.match(rest):
        lead = _LEAD_RE.match(rest) if cue else None
        if _DOUBT_OWN_RE.match(rest):
            return ""
        if lead is None or not _STATED_RE.match(rest, lead.end()):
            return None
        rest = rest[lead.end():]
    if rest.startswith(_BOX_CMDS):
        box = _outer_boxes(rest)
        return box[0][2] if box and box[0][0] == 0 else None
    lead = _lead_math(rest)
    if lead is not None:
        return lead[2]
    said = _tidy(_CLAUSE_END_RE.split(rest, maxsplit=1)[0])
    if re.search(r"(?<![\\A-Za-z])[A-Za-z]{2,}", re.sub(r"\\[A-Za-z]+", " ", said)):
        if _HEDGE_WORDS_RE.search(said):
            return ""       # 'the answer is 12 or 13'
        num = _NUMBER_RE.match(said) if cue else None  # '15 apples' after a cue: the number, with a known unit
        return num.group(0) + _unit_after(said, num.end())[1] if num else None
    return said


def _tail_agrees(tail: str, value: str) -> bool:
    """The text after an answer (a box, a cue's math) neither continues its value nor states a final answer that
    differs from it (the tail rule above): prose passes, the same value restated pays."""
    tail = tail[:4000]
    if _CONTINUES_RE.match(tail):
        return False
    m = _RESTATE_RE.match(tail)
    said = [_stated(tail[m.end():], cue=False)] if m and m.end() > 0 else []
    said += [_stated(tail[c.end():]) for c in _CUE_RE.finditer(tail)]
    return len(said) <= _MAX_STATED and all(s is None or (s != "" and _agrees(s, value)) for s in said)


def _agrees(said: str, value: str) -> bool:
    """The same value either way round, or a decimal rounding it within 1% ('\\boxed{\\frac13} = 0.333...')."""
    if said.strip() == value.strip() or _same_value(said, value):
        return True
    said = re.sub(r"(?:\.\.\.|\\[lc]?dots|…)$", "", said.strip())
    return re.fullmatch(r"-?\d*\.\d+", said) is not None and is_equivalent(said, value, rel_tol=MINERVA_REL_TOL)


# Known units right after the final box ('\\boxed{1.6} \\mathrm{~cm}', '\\boxed{5}$ inches per second.'): words of
# the unit tables, '/', powers, degree and percent signs, \\pmod; spacing and delimiters skipped.
_UNIT_PIECE_RE = re.compile(r"\s+|\$|\\[,;! ]|~|/|\{\s*\}|\\q?quad(?![A-Za-z])|\\cdot(?![A-Za-z])|"
                            r"\\pmod\s*(?:\{\s*\w+\s*\}|\w+)|\^\s*\{?\s*-?[123]\s*\}?|\^\s*\{?\s*\\circ\s*\}?|°|\\?%|"
                            r"\{\s*~?\s*([A-Za-z]+)\s*\}|\\(AA)(?![A-Za-z])|\\(?:text|mathrm|mbox|rm|operatorname)\s*"
                            r"\{\s*~?\s*([A-Za-z]+)\s*\}|([A-Za-z]+)(?![A-Za-z])")
_SIGNS = ("circ", "°", "%", "pmod")


def _unit_after(text: str, pos: int) -> tuple[int, str]:
    """(end, unit) of the known unit right after text[pos] ((pos, '') when none): words of the unit tables
    ('per' joins them), '/', powers and signs."""
    words, signs, end, k = [], [], pos, pos
    for _ in range(16):
        m = _UNIT_PIECE_RE.match(text, k)
        if m is None or m.end() == k:
            break
        w, piece = next((g for g in m.groups() if g), None), m.group(0).strip()
        if w is not None and w not in _UNIT_DIMS and w not in _UNIT_WORDS and w != "per" and \
                not (words and w in ("squared", "cubed")):      # 'meters per second squared'
            break
        k = m.end()
        if w is not None or piece == "/":
            words.append(w or "/")
        elif piece not in ("", "$", "~") and not piece.startswith("\\") or any(t in piece for t in _SIGNS):
            signs.append(piece)
        else:
            continue
        end = k
    text_part = " ".join(words).replace(" / ", "/").strip("/ ")
    unit = (" \\text{ " + text_part + "}" if text_part else "") + "".join(signs)
    return (end, unit) if text_part or any(t in x for x in signs for t in _SIGNS) else (pos, "")


# A box is an operand when an operator, a number or a command taking it as an argument stands right
# before it (what follows it is the tail rule's).
_OPERAND_BEFORE_RE = re.compile(r"(?:[-*/^_)\]|\d≠]|(?<![=(,&\s])\s*\+|\\(?:ne|neq)(?![A-Za-z])|"
                                r"\\(?:cdot|times|div|pm|mp|sqrt|frac|dfrac|tfrac|binom)"
                                r"|(?:\\(?:sqrt|frac|dfrac|tfrac|binom|overline)|[\^_}\]])\s*\{)\s*$")
# Markdown before a box is no operator: '**\\boxed{7}**', '*\\boxed{7}*'.
_MARKDOWN_BEFORE_RE = re.compile(r"(?:(?:^|(?<=[\s:(A-Za-z]))(?:\*+|__+)\s*)+$")
_DELIMS_RE = re.compile(r"\$|\\[()\[\]]|\\[ ,;!]|\\(?:quad|qquad)(?![A-Za-z])")
# Logic applied to a box makes no answer: '\\lnot\\boxed{12}', '\\boxed{12} \\lor \\boxed{13}',
# '\\boxed{12} \\land x > 0' (math delimiters between the box and the operator change nothing). An implication
# before a box is 'hence' and stays an answer.
_LOGIC_BEFORE_RE = re.compile(r"(?:\\(?:lnot|neg|" + _LOGIC_OPS + r")(?![A-Za-z])|[¬∨∧⊕⇔]|" + _LOGIC_WORDS +
                              r")\s*$", re.IGNORECASE)
_LOGIC_WRAP_RE = re.compile(r"\\(?:text|mathrm|mathrel|mathbin|operatorname|textsf|textit|textbf|mbox)\s*\{|[{}]")
# The sentence around a box: where it starts and ends, outside math. A '.' ends a sentence only
# before a space or the end ('3.5' does not).
_SENTENCE_END_RE = re.compile(r"[.!?](?=[\s$]|\\[)\]]|$)|[;\n]|。|！|？")
# A box inside the antecedent of a condition ('Were it \\boxed{12}, ...', 'If the count were \\boxed{12}, ...',
# 'Suppose the answer is \\boxed{12}; ...'): an opener with no ',', ':' or 'then' between it and the box.
_COND_OPEN_RE = re.compile(r"(?:^|[,:(]\s*)(?:were|had|should)\s+(?:it|we|they|he|she|you|the|this|that|there|I)\b|"
                           r"(?<![A-Za-z])(?<!only\s)(?<!even\s)(?<!as\s)(?:if(?!\s+and\s+only)|suppose|supposing|"
                           r"assume|assuming|unless|provided|whether|let|"
                           r"in\s+case|say|imagine|pretend)(?![A-Za-z])", re.IGNORECASE)
_COND_CLOSE_RE = re.compile(r"[,:]|(?<![A-Za-z])then(?![A-Za-z])", re.IGNORECASE)
# A conditional after the box in its own sentence ('\\boxed{12} if n is even'); 'would' before a box counts only
# beside a condition or a contrast (below).
_COND_AFTER_RE = re.compile(r"(?<![A-Za-z])(?:if|unless|provided|assuming|supposing|in\s+case)(?![A-Za-z])",
                            re.IGNORECASE)
_WOULD_RE = re.compile(r"(?<![A-Za-z])(?:would|'d)(?![A-Za-z])", re.IGNORECASE)
# After a 'would' box, a contrast or another stated value: 'It would have been \\boxed{12} with six sides; with
# eight it is 16.' ('she would have saved \\boxed{550} gallons', the answer to a 'would' question, stays one).
_CONTRAST_RE = re.compile(r"(?<![A-Za-z])(?:but|however|actually|in\s+fact|instead|whereas|yet)(?![A-Za-z])|"
                          r"(?<![A-Za-z])(?:is|are|equals|was)\s+\$?\s*[-\d\\]", re.IGNORECASE)
# A box attributed to an error ('The usual slip gives \\boxed{12}', 'A common mistake is to answer
# \\boxed{12}'), unless the words between the error and the box assert ('Avoiding the mistake, we get').
_ERROR_RE = re.compile(r"(?<![A-Za-z])(?:slip|slips|mistakes?|mistaken(?:ly)?|erroneous(?:ly)?|wrong(?:ly)?|"
                       r"incorrect(?:ly)?|careless(?:ly)?|na[iï]ve(?:ly)?|misread\w*|miscount\w*|misapplie\w*|"
                       r"typos?|blunders?|fallac\w+|pitfalls?|traps?|tempting|bogus|flawed|"
                       r"errors?(?=(?:\W+\w+){0,4}?\W+(?:gives?|gave|yields?|yielded|leads?|led|produces?|"
                       r"produced|results?|resulted|would|makes?|made)(?![A-Za-z])))(?![A-Za-z])",
                       re.IGNORECASE)
_ERROR_EXEMPT_BEFORE_RE = re.compile(r"(?<![A-Za-z])(?:avoid\w*|correct\w*|fix\w*|without|instead\s+of|rather\s+than|"
                                     r"no|not|free\s+of|repair\w*)\W+(?:\w+\W+){0,3}$", re.IGNORECASE)
_ASSERT_MARK_RE = re.compile(r"(?<![A-Za-z])(?:we\s+(?:get|obtain|find|have)|gives\s+us|so|thus|hence|therefore|"
                             r"(?:correct|right|true|actual|final)\s+(?:answer|value|count|total|result)|"
                             r"correct(?:ly|ed)?|instead|actually|in\s+fact|but|answer\s+is)(?![A-Za-z])|:",
                             re.IGNORECASE)
# Doubt about the box's answer, in its own sentence after it or in the next sentence ('\\boxed{12}? Unsure.',
# '\\boxed{12}. I am not sure this is right.', '\\boxed{12} (unverified)').
_DOUBT_RE = re.compile(r"(?<![A-Za-z])(?:unsure|not\s+(?:\S+\s+){0,2}?(?:sure|certain|confident|verified|checked)|"
                       r"uncertain|unverified|unchecked|untested|unconfirmed|tentative(?:ly)?|no\s+idea|i\s+doubt|"
                       r"doubtful|low\s+confidence|please\s+(?:double[-\s])?check|"
                       r"(?:might|could|may)\s+be\s+wrong|probably\s+wrong|just\s+a\s+guess|a\s+guess|"
                       r"or\s+is\s+it|(?:right|correct)\s*\?|no,?\s+wait|wait,?\s+no|scratch\s+that|"
                       r"on\s+second\s+thought|i\s+was\s+wrong|(?:that|this)(?:'s|\s+is)\s+wrong)(?![A-Za-z])",
                       re.IGNORECASE)
_DOUBT_OWN_RE = re.compile(r"(?<![A-Za-z])(?:maybe|perhaps|possibly|probably|presumably|i\s+guess|i\s+suppose|"
                           r"or\s+so)(?![A-Za-z])", re.IGNORECASE)


def _logic_before(text: str, start: int) -> bool:
    """A logic operator stands right before the boxes at text[start] (delimiters skipped; after them it is
    the tail rule's)."""
    before = _LOGIC_WRAP_RE.sub(" ", _DELIMS_RE.sub(" ", text[max(0, start - 40):start]))   # '\\mathrel{\\lnot}'
    return _LOGIC_BEFORE_RE.search(before) is not None


def _sentence_of(text: str, start: int, end: int) -> tuple[str, str, str, str]:
    """(head, tail, terminator, next sentence) of the sentence holding text[start:end]: the words of its
    sentence before and after it, the character that ends the sentence ('' at the end of the text) and
    the sentence after that (up to 160 characters each way)."""
    head = text[max(0, start - 240):start]
    cut = None
    for cut in _SENTENCE_END_RE.finditer(head):
        pass
    if cut is not None:
        head = head[cut.end():]
    rest = text[end:end + 400]
    m = _SENTENCE_END_RE.search(rest)
    if m is None:
        return head, rest, "", ""
    nxt = rest[m.end():]
    n = _SENTENCE_END_RE.search(nxt.lstrip(), 1)
    return head, rest[:m.start()], m.group(0), (nxt.lstrip()[:n.end()] if n else nxt)[:160]


def _in_math(text: str, pos: int) -> bool:
    """text[pos] is inside a math span: an odd number of unescaped '$' before it, or an open '\\(' / '\\['."""
    b, r = text[:pos], text[:pos].rfind
    return (b.count("$") - b.count("\\$")) % 2 == 1 or r("\\(") > r("\\)") or r("\\[") > r("\\]")


def _asserted(text: str, start: int, end: int) -> bool:
    """The sentence around the boxes (or math span) text[start:end] asserts them: not inside a condition ('Were
    it \\boxed{12}, ...', 'we would get \\boxed{12}' beside a condition or a contrast), not attributed to an error
    ('The usual slip gives \\boxed{12}'); for a last math span without the tail rule also not questioned or
    doubted after it ('$12$? Unsure.', '$12$ if n is even'). Decided from the response alone."""
    head, tail, end_mark, nxt = _sentence_of(text, start, end)
    if _in_math(text, start):       # the math the box sits in ('$x = \\boxed{12}$') is not words
        head = re.sub(r"(?:\$\$?|\\[(\[])[^$]*$", " ", head)
        tail = re.sub(r"^[^$]*?(?:\$\$?|\\[)\]])", " ", tail, count=1)
    head, tail = _MATH_SPAN_RE.sub(" $ ", head), _MATH_SPAN_RE.sub(" $ ", tail)     # words, not math
    if end_mark in ("?", "？") or "?" in tail or _DOUBT_RE.search(tail) or _DOUBT_OWN_RE.search(tail) or \
            _DOUBT_RE.search(nxt):
        return False
    opener = None
    for opener in _COND_OPEN_RE.finditer(head):
        pass
    if opener is not None and not _COND_CLOSE_RE.search(head[opener.end():]):
        return False        # the box is inside the condition
    if _COND_AFTER_RE.search(tail):
        return False
    mark = None
    for mark in _ASSERT_MARK_RE.finditer(head):
        pass
    clause = head[mark.end():] if mark is not None else head     # 'If it were 12, it would be odd, so it is'
    if _WOULD_RE.search(clause) and (_COND_OPEN_RE.search(clause) or _CONTRAST_RE.search(tail + " " + nxt)):
        return False        # 'Had we ..., we would get \\boxed{12}'; 'it would have been \\boxed{12} ...; it is 16'
    err = None
    for err in _ERROR_RE.finditer(head):
        pass
    if err is not None and not _ASSERT_MARK_RE.search(head[err.end():]) and \
            not _ERROR_EXEMPT_BEFORE_RE.search(head[:err.start()]):
        return False
    return True


def _is_operand(text: str, start: int, end: int) -> bool:
    """The box text[start:end] is part of a larger expression, not an answer of its own."""
    before = text[max(0, start - 12):start]
    if "$" in before:
        before = before[before.rindex("$") + 1:]
    return _OPERAND_BEFORE_RE.search(_MARKDOWN_BEFORE_RE.sub("", before)) is not None


def _is_join_gap(gap: str) -> bool:
    """True when the text between two boxes / spans only joins them (', ', ' and ', ' or y = ', or
    nothing at all: '\\boxed{1}\\boxed{2}')."""
    g = re.sub(r"\$|\\[()\[\]]", " ", gap)
    return not gap or bool(g.strip() and _JOIN_GAP_RE.fullmatch(g) and re.search(r"[,;]|and|or|=", g, re.I))


def _join(parts: list[str]) -> str:
    parts = [p.strip() for p in parts if p.strip()]
    if len(set(parts)) == 1:
        return parts[0]     # the same answer boxed twice
    return ", ".join(parts)


def _end_of_turn(text: str) -> str:
    """The response up to its first end-of-turn marker (leading markers are skipped) and up to a next turn
    or few-shot problem ('Question:', 'User:', '### Instruction') written after its first box or answer cue:
    a box in a made-up next turn is never the answer."""
    for m in _TURN_END_RE.finditer(text):
        if text[:m.start()].strip() and not _TURN_END_RE.fullmatch(text[:m.start()].strip()):
            text = text[:m.start()]
            break
    box = min((p for p in (text.find("\\boxed"), text.find("\\fbox")) if p >= 0), default=-1)
    phrase = _ANSWER_PHRASE_RE.search(text) if box < 0 else None
    if box >= 0 or phrase:   # a next problem counts only after the response has given an answer
        m = _NEXT_PROBLEM_RE.search(text, (box if box >= 0 else phrase.start()) + 1)
        if m:
            return text[:m.start()]     # a box in a made-up next turn is never the answer
    return text


# Thinking, hidden content and digits of other scripts (departure 24).
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL)
_HIDDEN_CMDS = ("phantom", "hphantom", "vphantom", "cancel", "bcancel", "xcancel", "sout", "st", "xout",
                "cancelto", "iffalse")
_HIDDEN_RE = re.compile(r"\\iffalse(?![A-Za-z]).*?(?:\\fi(?![A-Za-z])|$)|<!--.*?(?:-->|$)|^[ \t]*%.*$|~~[^~\n]*~~|"
                        r"\{\s*\\color\s*\{\s*white\s*\}[^{}]*(?:\{[^{}]*\}[^{}]*)*\}",
                        re.DOTALL | re.MULTILINE)
_HIDDEN_CMD_RE = re.compile(r"(?:\\(?:" + "|".join(_HIDDEN_CMDS) + r")(?![A-Za-z])|"
                            r"\\(?:textcolor|colorbox)\s*\{\s*white\s*\})\s*(?=\{)")
_COLOR_RE = re.compile(r"\\(?:textcolor|colorbox)\s*\{[^{}]*\}\s*(?=\{)|\\color\s*\{[^{}]*\}")
_DIGIT_FOLD = {**{0xFF10 + k: str(k) for k in range(10)}, **{0x0660 + k: str(k) for k in range(10)},
               **{0x06F0 + k: str(k) for k in range(10)}, 0xFF0C: ",", 0xFF0E: ".", 0xFF1A: ":", 0xFF08: "(",
               0xFF09: ")", 0xFF0B: "+", 0xFF0D: "-", 0xFF1D: "=", 0xFF0F: "/", 0x066B: ".", 0x066C: ","}


def _fold_digits(text: str) -> str:
    """Full-width and Arabic-Indic digits (and full-width signs) as ASCII: '４５' and '٤٥' are 45."""
    return text.translate(_DIGIT_FOLD) if not text.isascii() else text


def _after_thinking(text: str) -> str:
    """Nothing inside <think> ever counts: closed <think>..</think> blocks go, an unclosed '<think>'
    hides everything after it, then only what follows the last '</think>' is kept (a chat template
    that opens <think> in the prompt). One pass over the text (no regex: 30,000 unclosed tags)."""
    if "<think>" in text:
        out, pos = [], 0
        while True:
            k = text.find("<think>", pos)
            if k < 0:
                out.append(text[pos:])
                break
            out.append(text[pos:k])
            e = text.find("</think>", k)
            if e < 0:
                break
            pos = e + len("</think>")
        text = " ".join(out)
    head, sep, after = text.rpartition("</think>")
    return after if sep else text


def _visible(text: str) -> str:
    """The text a reader sees: comments (a '%' line, <!-- -->, \\iffalse .. \\fi), white text and the
    arguments of \\phantom, \\cancel, \\sout ... are removed, with any box inside them."""
    if "\\" not in text and "<!--" not in text and "%" not in text:
        return text
    text = _HIDDEN_RE.sub(" ", text)
    for _ in range(50):
        m = _HIDDEN_CMD_RE.search(text)
        if m is None:
            break
        end = _match_brace(text, m.end())
        if m.group(0).startswith("\\cancelto") and end > 0:
            end = _match_brace(text, end + 1) if text[end + 1:end + 2] == "{" else end
        text = text[:m.start()] + " " + (text[end + 1:] if end > 0 else "")
    return _COLOR_RE.sub("", text)      # '\\textcolor{red}{\\boxed{7}}' is the box


def _answer_tag(text: str) -> str | None:
    """Content of the last <answer>..</answer> (an unclosed last tag runs to the end)."""
    if "<answer>" not in text:
        return None
    m = None
    for m in _ANSWER_TAG_RE.finditer(text):
        pass
    return m.group(1).replace("<answer>", " ").replace("</answer>", " ").strip() if m else None


def _math_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, content) of the $..$, $$..$$, \\(..\\) and \\[..\\] spans of text, in order."""
    out = []
    for m in _MATH_SPAN_RE.finditer(text):
        content = next(g for g in m.groups() if g is not None)
        if len(out) > 10_000:
            break
        out.append((m.start(), m.end(), content))
    return out


def _tidy(ans: str) -> str:
    """Trailing sentence punctuation, stray delimiters and 'I hope it is correct' go."""
    ans = re.split(r"\s*I hope it is correct", ans, maxsplit=1, flags=re.IGNORECASE)[0]
    ans = ans.strip().strip("*").strip()
    ans = re.sub(r"^(?:\\\(|\\\[|\$+)|(?:\\\)|\\\]|\$+)$", "", ans).strip()
    if ans.endswith("..."):         # '1, 3, 5, ...' is an open list: its dots are not a full stop
        return ans
    return ans.rstrip(".,;:").strip()


def _after_phrase(text: str) -> str | None:
    """The answer that follows the last 'answer is' / 'Answer:' / '####' of text, if any ('' when the
    answer after the cue is hedged or negated: no answer at all)."""
    m = None
    for m in _ANSWER_PHRASE_RE.finditer(text):
        pass
    if m is None:
        return None
    rest = text[m.end():].lstrip(" \t*")
    lead = _lead_math(rest)
    if lead is not None:
        start, end, ans = lead
        off = len(text) - len(rest)
        if not _tail_agrees(rest[end:], ans) or not _asserted(text, off + start, off + end):
            return ""       # the tail rule: 'the answer is $7$ or maybe $8$', '所以 $x = 45$ 或 $46$'
        return ans or None
    line = rest.split("\n", 1)[0]
    said_line = re.split(r"(?<!\d)\.(?!\d)(?=\s|$)", line, maxsplit=1)[0]
    if "?" in line[:200] or _COND_AFTER_RE.search(said_line) or _DOUBT_RE.search(said_line) or \
            _DOUBT_OWN_RE.search(said_line):
        return ""           # 'So the answer is 12? Unsure.', 'the answer is 12 if n is even': no answer
    if _CJK_RE.search(line):        # '所以他一共走了45公里。': the one number of the sentence
        line = re.split(r"[。！？]", line, maxsplit=1)[0]
        nums = _NUMBER_RE.findall(line)
        return nums[0] if len(nums) == 1 and not _CJK_HEDGE_RE.search(line) else ""   # '' : cue, no answer
    line = re.split(r"(?<!\d)\.(?!\d)(?=\s|$|[A-Z])|\s+(?:since|because|which|as)\s", line, maxsplit=1)[0]
    said = None
    for said in _IS_VALUE_RE.finditer(line):      # 'The smallest $k$ is 12': what follows the last 'is'
        pass
    if said is not None and re.match(r"[A-Za-z]", line.strip()):
        line = said.group(1)
    return _tidy(line) or None


def _last_math(text: str) -> str | None:
    """The last math span of the last paragraph that has one, joined with the spans just before it
    that belong to the same answer ('$x=2$ and $x=-3$'); '' when its sentence does not assert it."""
    spans = _math_spans(text)
    if not spans:
        return None
    out = [spans[-1]]
    for s in reversed(spans[:-1]):
        if len(out) >= _MAX_JOIN or not _is_join_gap(text[s[1]:out[0][0]]):
            break
        out.insert(0, s)
    if not _asserted(text, out[0][0], out[-1][1]):
        return ""          # 'Were it $12$, the sum would be odd.': the sentence does not assert it
    return _tidy(_join([_tidy(c) for _, _, c in out])) or None


def _is_bare_answer(text: str) -> bool:
    """A whole response that is only an answer: one short line that is one token, a line of code,
    or without words (runs of two or more letters other than function names, 'or' and 'and',
    outside LaTeX commands and \\text{..})."""
    t = text.strip()
    if not t or len(t) > 200 or "\n" in t or _CJK_RE.search(t):
        return False
    if " " not in t or _PY_SYNTAX_RE.search(t) or any(m.group(1) not in _FUNCS for m in _CALL_RE.finditer(t)):
        return True         # one token ('abc0', 'Evelyn') or a line of code: judged whole, not its digits
    bare = re.sub(r"\\[A-Za-z]+", " ", re.sub(r"\\text\s*\{[^{}]*\}", " ", t))
    words = re.findall(r"(?<![\\A-Za-z])[A-Za-z]{2,}", bare)
    return all(w in _FUNCS or w.lower() in ("or", "and") for w in words)


# ------------------------------------------------------------------------------------------------
# Cleaning: LaTeX that carries no mathematical meaning is removed before parsing.

_FONT_CMDS = ("mathrm", "mathbf", "mathit", "mathsf", "mathtt", "mathcal", "mathbb", "boldsymbol",
              "bm", "operatorname", "textup", "emph")
_TEXT_CMDS = ("textbf", "textrm", "textit", "textsf", "texttt", "textnormal", "mbox", "hbox")
_SPACING_RE = re.compile(r"(?<!\\)\\(?:[!,;: ]|(?:quad|qquad|displaystyle|textstyle|limits|nolimits|tiny|scriptsize|"
                         r"footnotesize|small|normalsize|large|Large|LARGE|huge|Huge|"
                         r"big|Big|bigg|Bigg|bigl|bigr|Bigl|Bigr|biggl|biggr)(?![a-zA-Z]))")
_LEFTRIGHT_RE = re.compile(r"\\(?:left|right)(?![a-zA-Z])\s*(\.)?")
_DEGREE_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\^\s*\{\s*\\text\{\s*o\s*\}\s*\}|\\circ|°|"
                        r"\\degree(?![a-zA-Z])")
_THOUSANDS_MARK_RE = re.compile(r"(?<=\d)(?:,\\!|\{,\}|\\,|,\\,)\s*(?=\d{3}(?!\d))")
_PLAIN_THOUSANDS_RE = re.compile(r"^[+-]?(?!0,)\d{1,3}(?:,\d{3})+(?:\.\d+)?$")    # not 0,125
_SPACE_THOUSANDS_RE = re.compile(r"^[+-]?\d{1,3}(?: \d{3})+(?:\.\d+)?$")
_TRAILING_TEXT_RE = re.compile(r"^(.*?\S)\s*\\text\s*\{([^{}]*)\}\s*(?:\^\s*\{?\s*[23]\s*\}?)?\s*$",
                               re.DOTALL)
_IN_PREFIX_RE = re.compile(r"^\s*[a-zA-Z]\s*\\in\s*")
_OR_RE = re.compile(r",?\s*\\text\{\s*,?\s*(?:or|and)\s*\}\s*,?|,?\s(?:or|and)\s",
                    re.IGNORECASE)
_UNIT_WORDS = frozenset((
    "cm", "m", "mm", "km", "in", "inch", "inches", "ft", "feet", "foot", "yd", "yards", "miles",
    "mile", "meter", "meters", "metres", "units", "unit", "sq", "square", "cubic", "degrees",
    "degree", "deg", "cents", "cent", "dollars", "dollar", "s", "sec", "seconds", "second", "min",
    "minutes", "minute", "hours", "hour", "hrs", "h", "days", "day", "weeks", "years", "kg", "g",
    "grams", "gram", "lb", "lbs", "pounds", "mph", "kph", "J", "K", "N", "W", "Hz", "eV", "keV",
    "MeV", "GeV", "nm", "um", "AU", "pc", "kpc", "Mpc", "ly", "V", "A", "Pa", "atm", "mol", "L",
    "ml", "mL", "C", "F", "people", "ways", "students", "times", "percent", "pct", "points", "USD", "EUR", "GBP",
    "euros", "euro", "hr", "ms", "cm2", "liters", "litres", "gallons", "ounces", "oz", "tons", "mi", "km2",
    "integers", "digits", "numbers", "edges", "faces", "vertices", "multiples", "terms", "gm", "apples", "coins",
    "marbles", "cards", "balls", "books", "pages", "boxes", "pieces", "games", "rows", "seats", "chairs",
    "children", "boys", "girls", "men", "women", "friends", "hits", "handshakes", "triangles", "squares",
    "erg", "ergs", "parsec", "parsecs", "arcsec", "arcsecs", "arcseconds", "arcmin", "angstrom", "angstroms",
    "Angstrom", "Angstroms", "AA", "amu", "Gyr", "Myr", "bits", "magnitudes", "kcal", "Volt", "volts", "mole",
))
_REALS_RE = re.compile(r"\\mathbb\s*\{\s*R\s*\}|\\R(?![a-zA-Z])|ℝ")
_EMPTY_RE = re.compile(r"\\(?:emptyset|varnothing)(?![a-zA-Z])|∅")
_PERCENT_WORD_RE = re.compile(r"(\d)\s*(?:\\(?:text|mbox|mathrm)\s*\{\s*)?"
                              r"(?:percentage|percent|per\s*cent|pct)\.?(?:\s*\})?(?![A-Za-z])", re.IGNORECASE)
_ORDINAL_RE = re.compile(r"^(\s*\d+)\s*(?:\^\s*)?(?:\{\s*)?(?:\\(?:text|mathrm)\s*\{\s*)?"
                         r"(?:st|nd|rd|th)\s*\}?\s*\}?\s*$")
_CURRENCY_RE = re.compile(r"[€£¥₹]")
_CURRENCY_WORD_RE = re.compile(r"^\s*(?:USD|EUR|GBP|JPY|INR|CHF|US\s*\$|Rs\.?)\s*(?=[+-]?\d)")
_SET_BUILDER_RE = re.compile(r"\\\{\s*([a-zA-Z])\s*(?:\\in\s*\(-\\infty,\\infty\)\s*)?(?:\||:)")
_INEQ_RE = re.compile(r"[<>]|\\(?:le|ge|lt|gt|ne)(?![a-zA-Z])")
_NUMPY_RE = re.compile(r"(?<![A-Za-z_.])(?:np|numpy|math)\.(?=(?:" + "|".join(
    ("arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "sin", "cos", "tan", "exp", "log10", "log", "sqrt",
     "pi", "e", "floor", "ceil", "abs", "gcd")) + r")(?![A-Za-z_]))")
_PAREN_RELATION_RE = re.compile(r"(?<![^\s{},])\(\s*([^(),]*?(?:[<>]|\\(?:le|ge|lt|gt|ne)(?![a-zA-Z]))[^(),]*?)\s*\)")
_AND_RE = re.compile(r",?\s*\\text\{\s*,?\s*and\s*\}\s*,?|,?\s(?:and)\s", re.IGNORECASE)
_OR_ONLY_RE = re.compile(r",?\s*\\text\{\s*,?\s*or\s*\}\s*,?|,?\s(?:or)\s", re.IGNORECASE)
# Text after a value that is not a unit: digits, brackets, or words that qualify or hedge the value.
_HEDGE_TEXT_RE = re.compile(r"[\d()\[\]=<>]|(?<![A-Za-z])(?:or|and|not|no|maybe|perhaps|possibly|probably|either|"
                            r"unless|if|except|but|more|less|fewer|least|most|than|at|is|are|was|wrong|sure|"
                            r"answer|guess|correct|incorrect|depending|about|around|approximately|roughly|to|"
                            r"between|plus|minus|etc|doubled|halved|tripled|squared|cubed|factorial|onwards?|up|"
                            r"above|below|under|over|inverse|reciprocal|times|mod|false|impossible|excluded|off|"
                            r"invalid|rejected|negative|opposite|rounded|later|earlier|ago|before|after|greater|beyond|"
                            r"minimum|maximum|upwards?|downwards?|negated|inverted|halves|thirds|quarters|fourths|"
                            r"fifths|"
                            r"tenths|hundredths)(?![A-Za-z])",
                            re.IGNORECASE)
# Number words after a value multiply it: '7 \\text{ thousand}' is 7000.
_MULTIPLIERS = {"halves": "\\frac12", "thirds": "\\frac13", "quarters": "\\frac14", "fourths": "\\frac14",
                "fifths": "\\frac15", "tenths": "\\frac1{10}", "hundredths": "\\frac1{100}",
                "hundred": 100, "thousand": 1000, "million": 10 ** 6, "billion": 10 ** 9, "trillion": 10 ** 12,
                "dozen": 12}
# Units by dimension, with their size in the dimension's base unit. A unit is dropped only when the
# other side has none or the same one (departure 12): '5 km' is not '5 m', '7 cents' is not '$7'.
_UNIT_DIMS = {}
for _dim, _table in (
        ("length", {1e-9: "nm", 1e-3: "mm millimeter millimeters millimetre millimetres", 1e-2:
                    "cm centimeter centimeters centimetre centimetres", 1: "m meter meters metre metres",
                    1e3: "km kilometer kilometers kilometre kilometres", 0.0254: "in inch inches",
                    0.3048: "ft foot feet", 0.9144: "yd yard yards", 1609.344: "mi mile miles"}),
        ("time", {1e-3: "ms millisecond milliseconds", 1: "s sec secs second seconds", 60: "min mins minute minutes",
                  3600: "h hr hrs hour hours", 86400: "day days", 604800: "week weeks wk wks",
                  2629800: "month months", 31557600: "yr yrs year years"}),
        ("mass", {1e-3: "mg milligram milligrams", 1: "g gm gram grams", 1e3: "kg kilogram kilograms kilo kilos",
                  453.59237: "lb lbs pound pounds", 28.349523: "oz ounce ounces", 1e6: "ton tons tonne tonnes"}),
        ("volume", {1e-3: "ml mL milliliter milliliters millilitre millilitres", 1: "L l liter liters litre litres",
                    3.785411784: "gal gallon gallons"}),
        ("usd", {1: "dollar dollars USD", 0.01: "cent cents"}), ("eur", {1: "euro euros EUR"}),
        ("gbp", {1: "GBP"}), ("angle", {1: "rad rads radian radians", math.pi / 180: "deg degree degrees"}),
        ("speed", {0.44704: "mph mi/h", 1 / 3.6: "kph kmh km/h", 1: "m/s", 0.3048: "ft/s"})):
    for _size, _words in _table.items():
        for _w in _words.split():
            _UNIT_DIMS[_w] = (_dim, _size)
_UNIT_TAIL_RE = re.compile(r"(?:\\(?:text|mbox|mathrm|textrm|rm)\s*\{\s*([A-Za-z]+(?:\s*/\s*[A-Za-z]+)?)\.?\s*\}|"
                           r"(?<![\\A-Za-z])([A-Za-z]+(?:/[A-Za-z]+)?)\.?)"
                           r"\s*(?:\^\s*\{?\s*([23])\s*\}?|([²³]))?\s*$")
_MONEY_RE = re.compile(r"\\\$|US\s*\$|^\s*\$\s*[\d.]|[\d.]\s*\$\s*$")
_TEMPERATURE_RE = re.compile(r"(?:\^\s*\{?\s*\\circ\s*\}?|°|\\degree)\s*(?:\\(?:text|mathrm)\s*\{\s*)?"
                             r"([CFK])\s*\}?\s*$|(?<=[\d}\s])(?:\\(?:text|mathrm)\s*\{\s*)?(K)\s*\}?\s*$")
_ANGLE_RE = re.compile(r"\^\s*\{?\s*\\circ|°|\\degree(?![A-Za-z])")


def _unit_of(s: str):
    """(dimension, size) of the unit a value is written with ('5 \\text{ km}', '\\$7', '30^\\circ',
    '9 \\text{ m}^2'), or None when it has no unit this file knows (lengths, times, masses, volumes,
    money, angles; a square or cube of a length)."""
    t = s.strip().rstrip(".").strip()
    if len(t) > 200 or not re.search(r"\d", t):
        return None
    if "squared" in t or "cubed" in t:
        t = re.sub(r"\s*\^(\d)\s*\}", r"}^\1", _unit_power_words(t))     # '\\text{ cm squared}' is cm^2
    m = _TEMPERATURE_RE.search(t)
    if m:
        return ("temperature " + (m.group(1) or m.group(2)), 1)     # 5 °C, 5 °F, 5 K: three temperatures
    if _ANGLE_RE.search(t) and not re.search(r"\\?(?:sin|cos|tan|sec|csc|cot)", t):
        return ("angle", math.pi / 180)
    for sym, dim in (("€", "eur"), ("£", "gbp")):
        if sym in t:
            return (dim, 1)
    m = _UNIT_TAIL_RE.search(t)
    if m and re.search(r"[\d})]\s*$", t[:m.start()]):
        unit = _UNIT_DIMS.get(re.sub(r"\s+", "", m.group(1) or m.group(2)))
        power = int(m.group(3) or {"²": 2, "³": 3}.get(m.group(4) or "", 1))
        if unit is not None:
            return unit if power == 1 else (f"{unit[0]}^{power}", unit[1] ** power)
    if _MONEY_RE.search(t):
        return ("usd", 1)
    return None
_UNIT_TOKEN_RE = re.compile(r"(?:([A-Za-z]+)|\\text\s*|\\mathrm\s*|\^\s*\{?-?[0-9]\}?|[\s{}/*·]|\\cdot|\\,)$")


_CHOOSE_RE = re.compile(r"(?<!\\)\{([^{}]*?)\\choose(?![a-zA-Z])([^{}]*?)\}")
_ASCII_MOD_RE = re.compile(r"(?<=[\d)\s])\s*(?<![A-Za-z\\])mod(?![A-Za-z])")
_SYMPY_CALL_RE = re.compile(r"(?<![A-Za-z\\])(Interval|FiniteSet|Union|Intersection|Eq|Rational|binomial|factorial|log)"
                            r"(?:\.(open|Lopen|Ropen))?\(")
_SYMPY_HINT_RE = re.compile(r"Interval|FiniteSet|EmptySet|Union\(|Intersection\(|Eq\(|Rational\(|Reals|Abs\(|"
                            r"ceiling\(|binomial\(|factorial\(|(?<!\\)log\([^()]*,")
_FN_WORDS = ("gcd", "lcm", "max", "min", "floor", "ceil", "det", "cosec", "arcsinh", "arccosh", "arctanh",
             "sinh", "cosh", "tanh", "lg", "ln", "log", "exp", "sec", "csc", "cot", "arcsin", "arccos", "arctan",
             "sech", "csch", "cosech", "coth", "arccot", "arcsec", "arccsc")
_FN_NAME_RE = re.compile(r"\\(?:operatorname|mathrm|text|rm)\s*\{\s*(" + "|".join(_FN_WORDS) + r")\s*\}")
_PMOD_RE = re.compile(r"\s*\\pmod\s*(?:\{[^{}]*\}|\w+)|\s*\(\s*\\(?:bmod|mod)\s*\w+\s*\)")
_ELLIPSIS_RE = re.compile(r"\\(?:ldots|cdots|dots|dotsc|dotsb)(?![a-zA-Z])|\.\.\.|…")
_DOUBLED_CMD_RE = re.compile(r"\\\\(le|ge|leq|geq|neq|ne|lt|gt|leqslant|geqslant|frac|dfrac|sqrt|in|infty|"
                             r"pi|cup|cap|text|times|cdot|pm|left|right|emptyset|varnothing|mathbb|"
                             r"approx|circ|sin|cos|tan|ln|log|boxed|\{|\})(?![a-zA-Z])")
_UNICODE = {"∞": "\\infty ", "π": "\\pi ", "×": "\\times ", "·": "\\cdot ", "÷": "\\div ",
            "≤": "\\le ", "≥": "\\ge ", "≠": "\\ne ", "√": "\\sqrt ", "−": "-", "–": "-",
            "≈": "\\approx ",
            "½": "\\frac12 ", "⅓": "\\frac13 ", "⅔": "\\frac23 ", "¼": "\\frac14 ", "¾": "\\frac34 ",
            "∪": "\\cup ", "∩": "\\cap ", "∈": "\\in ", "∖": "\\setminus ", "⁄": "/", "∕": "/",
            "⅛": "\\frac18 ", "⅜": "\\frac38 ", "⅝": "\\frac58 ", "⅞": "\\frac78 ", "⅕": "\\frac15 ",
            "⅖": "\\frac25 ", "⅗": "\\frac35 ", "⅘": "\\frac45 ", "⅙": "\\frac16 ", "⅚": "\\frac56 ",
            "⅐": "\\frac17 ", "⅑": "\\frac19 ", "⅒": "\\frac1{10} "}
_SPACES = {0x00A0: " ", 0x2009: " ", 0x202F: " ", 0x2007: " ", 0x2008: " ", 0x200A: " ", 0x3000: " "}
_SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁺", "0123456789-+")
_SUPERSCRIPT_RE = re.compile(r"[⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁺]+")
_OVER_RE = re.compile(r"(?<!\\)\{([^{}]*?)\\over(?![a-zA-Z])([^{}]*?)\}")
_PMOD_ONE_RE = re.compile(r"\\pmod\s*\{?\s*1\s*\}?(?![\d.])|\(\s*\\?(?:bmod|mod)\s*1\s*\)")
_MATHBB_SET_RE = re.compile(r"\\mathbb\s*\{\s*([NZQC])\s*\}|\\mathbb\s*([NZQC])(?![A-Za-z])")
_NUMBER_SETS = {"N": "ℕ", "Z": "ℤ", "Q": "ℚ", "C": "ℂ"}
_PAREN_REPEAT_RE = re.compile(r"(?<![\d.])(\d*)\.(\d*)\((\d{1,30})\)")
_EURO_NUMBER_RE = re.compile(r"[+-]?\d{1,3}(?:\.\d{3})+,\d+")
_REPEAT_RE = re.compile(r"(?<!\d)(\d*)\.(\d*)\\overline\s*\{(\d{1,30})\}")
_BASE_RE = re.compile(r"\d{1,2}|ten|two|eight|sixteen|b|d|h|o", re.IGNORECASE)     # 52_8, 12_{ten}
_FN_VALUE_RE = re.compile(r"\((-?\d{1,6})\)(?![\d.])")     # the '(0)' of I(0)
_FUNC_LHS_RE = re.compile(r"^\s*[a-zA-Z]\s*\(\s*(?:[a-z]|-?\d+(?:[./]\d+)?)\s*\)\s*=(?!.*=)")  # f(x) =, f(2) =


def _repeating_to_frac(m) -> str:
    """0.1\\overline{6} -> \\frac{15}{90}: a repeating decimal is an exact fraction."""
    whole, fixed, rep = m.group(1) or "0", m.group(2)[:30], m.group(3)
    num = int(whole + fixed + rep) - int(whole + fixed)
    den = 10 ** len(fixed) * (10 ** len(rep) - 1)
    return f"\\frac{{{num}}}{{{den}}}"


def _replace_cmd_wrapper(s: str, names: tuple[str, ...], repl: str) -> str:
    # \mathrm{x} -> {x} (repl="") or \mbox{x} -> \text{x} (repl="\\text")
    pat = re.compile(r"\\(?:" + "|".join(names) + r")(?![a-zA-Z])\s*(?=\{)")
    return pat.sub(lambda m: repl, s)


def _top_level_split(s: str) -> list[str]:
    """s split at the commas outside any brackets."""
    out, depth, start = [], 0, 0
    for k, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(s[start:k])
            start = k + 1
    return out + [s[start:]]


def _sympy_printed(s: str) -> str:
    """Answers as sympy prints them, rewritten to the LaTeX this parser reads (text only, nothing is
    evaluated): Interval(0, 1) -> [0, 1], Interval.open -> (..), FiniteSet(1, 2) -> \\{1, 2\\},
    EmptySet -> \\emptyset, Eq(a, b) -> a = b, Rational(1, 3) -> (1)/(3), Union(A, B) -> A \\cup B,
    Abs/ceiling/binomial/factorial -> abs/ceil/\\binom/!, log(x, b) -> log_b."""
    s = re.sub(r"\bEmptySet\b", "\\\\emptyset", s)
    s = re.sub(r"\b(?:S\.)?Reals\b", "(-\\\\infty,\\\\infty)", s)
    s = re.sub(r"\bAbs\(", "abs(", s)
    s = re.sub(r"\bceiling\(", "ceil(", s)
    for _ in range(20):
        m = _SYMPY_CALL_RE.search(s)
        if not m:
            break
        end = _match_paren(s, m.end() - 1)
        if end < 0:
            break
        args = [a.strip() for a in _top_level_split(s[m.end():end])]
        name, kind = m.group(1), m.group(2) or ""
        if name == "Interval" and len(args) == 2:
            o, c = {"": "[]", "open": "()", "Lopen": "(]", "Ropen": "[)"}[kind]
            new = f"{o}{args[0]}, {args[1]}{c}"
        elif name == "FiniteSet":
            new = "\\{" + ", ".join(args) + "\\}"
        elif name in ("Union", "Intersection"):
            new = (" \\cup " if name == "Union" else " \\cap ").join(args)
        elif name == "Eq" and len(args) == 2:
            new = f"{args[0]} = {args[1]}"
        elif name == "Rational" and len(args) == 2:
            new = f"({args[0]})/({args[1]})"
        elif name == "binomial" and len(args) == 2:
            new = f"\\binom{{{args[0]}}}{{{args[1]}}}"
        elif name == "factorial" and len(args) == 1:
            new = f"({args[0]})!"
        elif name == "log" and len(args) == 2:
            new = f"\\log_{{{args[1]}}}({args[0]})"
        else:
            break
        s = s[:m.start()] + new + s[end + 1:]
    return s


def _match_paren(s: str, start: int) -> int:
    depth = 0
    for k in range(start, len(s)):
        if s[k] == "(":
            depth += 1
        elif s[k] == ")":
            depth -= 1
            if depth == 0:
                return k
    return -1


def _fn_name(m) -> str:
    """\\operatorname{lcm} -> \\lcm; \\text{ min} after a number stays a unit (minutes, seconds)."""
    if m.group(0).startswith("\\text") and m.group(1) in _UNIT_WORDS:
        return m.group(0)
    return "\\" + m.group(1) + " "


def _clean(s: str) -> str:
    if not s.isascii():
        s = _fold_digits(s).translate(_SPACES)
        s = _SUPERSCRIPT_RE.sub(lambda m: "^{" + m.group(0).translate(_SUPERSCRIPTS) + "}", s)
    if "\\color" in s or "\\textcolor" in s or "\\colorbox" in s:
        s = _COLOR_RE.sub("", s)                                  # '\\textcolor{red}{7}' is 7
    if "\\over" in s:
        s = _OVER_RE.sub(r"\\frac{\1}{\2}", s)                       # '{3 \\over 4}' is 3/4
    if _PMOD_ONE_RE.search(s):
        return "\\text{mod 1}"         # every integer is congruent mod 1: no residue is stated
    s = _MATHBB_SET_RE.sub(lambda m: _NUMBER_SETS[m.group(1) or m.group(2)], s)     # 7\\mathbb{N} is no 7 N
    s = _PAREN_REPEAT_RE.sub(_repeating_to_frac, s)                   # 0.(3) is 1/3
    if _EURO_NUMBER_RE.fullmatch(s.strip().rstrip("€ ").strip()):
        s = s.replace(".", "").replace(",", ".")                      # 3.400,25 € is 3400.25
    if _SYMPY_HINT_RE.search(s):
        s = _sympy_printed(s)
    if "\\\\" in s and "\\begin" not in s:     # a JSON-escaped gold: '-3 \\\\le x' is '-3 \\le x'
        s = _DOUBLED_CMD_RE.sub(r"\\\1", s)
    s = _FN_NAME_RE.sub(_fn_name, s)                             # \operatorname{lcm} -> \lcm
    s = _PMOD_RE.sub("", s)                                      # 9 \pmod{11}: the residue 9
    s = _ELLIPSIS_RE.sub(lambda m: "\\ldots ", s)                 # one spelling, compared as text
    s = s.replace("\u2212", "-").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\cfrac", "\\frac").replace("\\dbinom", "\\binom").replace("\\tbinom", "\\binom")
    s = s.replace("\\lbrace", "\\{").replace("\\rbrace", "\\}").replace("\\lbrack", "[").replace("\\rbrack", "]")
    s = s.replace("\\langle", "(").replace("\\rangle", ")")       # a vector <1, 2> is the tuple (1, 2)
    s = _ORDINAL_RE.sub(r"\1", s)                                   # 5^{\text{th}}, 21st -> the number
    s = s.replace("\\lvert", "|")
    s = s.replace("\\rvert", "|").replace("\\vert", "|").replace("\\mid", "|")
    s = re.sub(r"\\(le|ge)(?:qslant|qq|slant)(?![a-zA-Z])", r"\\\1", s)
    s = s.replace("\\leq", "\\le").replace("\\geq", "\\ge").replace("\\neq", "\\ne")
    s = s.replace("\\not=", "\\ne ")
    s = _CHOOSE_RE.sub(r"\\binom{\1}{\2}", s)                     # {n \\choose k}
    s = _ASCII_MOD_RE.sub(r"\\bmod ", s)                            # 17 mod 5
    s = s.replace("!=", "\\ne ").replace("<=", "\\le ").replace(">=", "\\ge ")
    s = _REALS_RE.sub(lambda m: "(-\\infty,\\infty)", s)
    s = _EMPTY_RE.sub(lambda m: "\\{\\}", s)
    s = _PERCENT_WORD_RE.sub(r"\1%", s)
    s = _CURRENCY_RE.sub("", s)
    s = _CURRENCY_WORD_RE.sub("", s)                  # 'USD 1,250' (after the number: a unit word)
    s = s.replace("\\%", "%").replace("\\$", "").replace("$", "")
    s = _NUMPY_RE.sub("", s)                          # np.arcsin(10/13), math.pi: the function itself
    for u, latex in _UNICODE.items():
        if u in s:
            s = s.replace(u, latex)
    # "\sqrt12" and "√12" mean the root of 12 (TeX would read \sqrt{1}2): departure 13.
    s = re.sub(r"\\sqrt\s*(\d{2,})", r"\\sqrt{\1}", s)
    s = _REPEAT_RE.sub(_repeating_to_frac, s)
    s = _FUNC_LHS_RE.sub("", s)
    s = re.sub(r"\^\s*\{?\s*\\prime\s*\}?", "'", s)
    s = re.sub(r"^\s*\\approx", "", s)
    s = _THOUSANDS_MARK_RE.sub("", s)
    s = _SPACING_RE.sub(" ", s)
    s = _LEFTRIGHT_RE.sub("", s)
    s = _DEGREE_RE.sub("°", s)        # read by the parser: radians inside trig functions
    # \mathrm{cm} is text (a unit or a word); \mathrm{12} or \mathbf{x+1} is just a group.
    s = re.sub(r"\\(?:" + "|".join(_FONT_CMDS) + r")\s*\{([A-Za-z ]{2,})\}", r"\\text{\1}", s)
    s = _replace_cmd_wrapper(s, _FONT_CMDS, "")
    s = _replace_cmd_wrapper(s, _TEXT_CMDS, "\\text")
    s = s.replace("~", " ").strip()
    m = _SET_BUILDER_RE.match(s) if s.startswith("\\{") and s.endswith("\\}") else None
    if m:                                # {x | x > 0} is the set where the condition holds
        cond = s[m.end():-2].strip()
        if _INEQ_RE.search(cond) and m.group(1) in cond:
            s = cond
    s = _IN_PREFIX_RE.sub("", s)
    if _INEQ_RE.search(s):            # "x < -1 or x > 4" is a union, "x > 1 and x < 3" an intersection
        s = _PAREN_RELATION_RE.sub(r" \1 ", s)       # "(x < -1) or (x > 4)": brackets around relations go
        s = _AND_RE.sub(lambda m: " \\cap ", s)
        s = _OR_ONLY_RE.sub(lambda m: " \\cup ", s)
    s = _OR_RE.sub(", ", s)          # with a space: '4 or 7' is never the decimal 4,7
    # Units written as text after a value: "5.4 \text{ cents}", "864 \mbox{ inches}^2".
    for _ in range(3):
        m = _TRAILING_TEXT_RE.match(s)
        unit = _unit_power_words(m.group(2).strip(), "") if m else ""     # 'units squared' is a unit
        if m and unit.lower() in _MULTIPLIERS and re.fullmatch(r"[+-]?\d+(?:\.\d+)?", m.group(1).strip()):
            s = f"{m.group(1).strip()} \\cdot {_MULTIPLIERS[unit.lower()]}"     # '7 \\text{ dozen}' is 84
            break
        if m and re.fullmatch(r"\(?\s*exactly\s*\)?", unit):
            s = m.group(1).strip()
            continue
        if not m or m.group(1).endswith(("_", "^", "{")) or (
                len(unit) < 2 and unit not in _UNIT_WORDS) or _HEDGE_TEXT_RE.search(unit):
            break           # '4 \text{ or 5}', '12 \text{ (not sure)}': words about the value, not a unit
        s = m.group(1).strip()
    s = s.strip().rstrip(".,;").strip()
    if _PLAIN_THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    elif _SPACE_THOUSANDS_RE.match(s):
        s = s.replace(" ", "")
    return s


def _strip_plain_unit(s: str) -> str | None:
    """'12 cm' -> '12', '9.8 {m/s^2}' -> '9.8' for the last-try comparison (departure 12): a tail of
    known unit words (with / ^n {} between them) after a number. None when there is no such tail."""
    words, rest = [], s
    for _ in range(12):
        m = _UNIT_TOKEN_RE.search(rest)
        if m is None or m.start() == 0:
            break
        if m.group(1):
            words.append(m.group(1))
        rest = rest[:m.start()]
        if words and re.search(r"[\d%}]\s*$", rest) and rest.count("{") == rest.count("}"):
            if all(w in _UNIT_WORDS for w in words):
                return rest.strip()
            return None
    return None


# ------------------------------------------------------------------------------------------------
# The strictness rule (module docstring, "What counts as an answer"): the one place that decides
# whether a prediction is a mathematical answer at all. Every parse of a prediction goes through
# _parse(as_gold=False), which calls _check_math on the cleaned text, and the parser calls
# _check_product on every product it builds; a prediction that fails either raises _NotMath and is
# unequal to every gold: no other reading or leniency is tried.

_PY_SYNTAX_RE = re.compile(
    r"[\"`?@#]|=="                                   # quotes, backticks, Python's equality and decorators
    r"|(?<![A-Za-z0-9)}\]'])'|'(?=[A-Za-z0-9_'\"])"      # a quote that is not a prime (f'(x), y'')
    r"|[A-Za-z_]{2,}\.[A-Za-z_]|[A-Za-z_]\.[A-Za-z_]{2,}|__"   # dotted names (os.path, x.real; not p.m.), dunders
    r"|(?<![\\A-Za-z])(?:import|lambda|return)(?![A-Za-z])")
_NEGATED_RE = re.compile(r"\\text\s*\{\s*(?:not|no|never|wrong|false|incorrect|impossible)(?![A-Za-z])[^{}]*\}\s*\S",
                         re.IGNORECASE)
_CALL_RE = re.compile(r"(?<![\\A-Za-z])([A-Za-z]{3,})\(")   # run(0), print(x): a call of a name


# The text groups of an answer beside a value: their words must be known (units, scale words, 'or' / 'and',
# 'exactly', a choice letter) or carried by the gold too (``_unknown_units``): '12 \\text{ or thirteen}',
# '12 \\text{ modulo five}', '\\text{about } 12' are unequal to 12 by rule, not by a list of qualifiers.
_TEXT_GROUP_RE = re.compile(r"\\(?:text|mbox|textrm|textnormal|textit|textbf|textsf|mathrm|hbox|si|unit|SI)\s*"
                            r"\{([^{}]*)\}")
_UNIT_POWER_WORD_RE = re.compile(r"(?<![A-Za-z])([A-Za-z]+)\.?\s+(squared|cubed)(?![A-Za-z])", re.IGNORECASE)


def _unit_power_words(t: str, power: str = "^{}") -> str:
    """'units squared', 'cm cubed' -> 'units^2', 'cm^3' (a unit word before them; '7 squared' stays). power
    formats the exponent ('' drops it)."""
    return _UNIT_POWER_WORD_RE.sub(lambda m: m.group(1) + power.format(2 if m.group(2).lower() == "squared" else 3)
                                   if m.group(1) in _UNIT_WORDS or m.group(1) in _UNIT_DIMS else m.group(0), t)


def _check_math(s: str) -> None:
    """Raises _NotMath when the cleaned prediction s is not a mathematical answer: program syntax
    or a call of a name that is not a known function (the parser adds _check_product)."""
    if _PY_SYNTAX_RE.search(s):
        raise _NotMath("program syntax")
    if _NEGATED_RE.search(s):
        raise _NotMath("words that negate what follows")     # '\\text{not } x = 7'
    for m in _CALL_RE.finditer(s):
        if m.group(1) not in _FUNCS:
            raise _NotMath(f"call of {m.group(1)}")


def _check_product(factors: list, zero_written: bool) -> None:
    """Called by the parser for each product it builds (a term, a \\frac): a factor written as the
    literal 0 ('0', '(0)', '{0}') next to a factor that is not a number is not an answer: 'k0', 'v0w',
    'run(0)', '0x', '\\frac{0}{k}' would otherwise equal every gold 0."""
    if zero_written and not all(_numeric(f, 0) for f in factors):
        raise _NotMath("a product of 0 and a name")


def _numeric(e, depth: int) -> bool:
    """Built from numbers and constants alone (5, \\sqrt2, \\pi/180): no name and no function."""
    if isinstance(e, sympy.Rational) or e in (S.Pi, S.Exp1, S.ImaginaryUnit):
        return True
    if depth < 20 and isinstance(e, (sympy.Add, sympy.Mul, sympy.Pow)):
        return all(_numeric(a, depth + 1) for a in e.args)
    return False


# ------------------------------------------------------------------------------------------------
# Answer structures. Expressions are sympy objects; the rest are these small nodes.

@dataclass
class Val:
    expr: object                  # a sympy expression
    inexact: bool = False         # a decimal literal appears: compare with rel_tol
    percent: bool = False         # written with %: 10% equals 10 and 0.1 (departure 4)
    env: dict = field(default_factory=dict)   # fixed symbol values (the +- sign)
    half_ulp: Fraction | None = None  # a lone decimal literal: half a unit in its last place
    least_decimal: Fraction | None = None     # the smallest non-zero decimal literal written in it


@dataclass
class Eqn:
    lhs: Val
    rhs: Val
    op: str = "="


@dataclass
class Chain:
    """'t = 2+3+4 = 9', '\\frac17 \\approx 0.14', '-1 \\le x < 4': parts joined by relations."""
    parts: list                   # list of Val
    ops: list                     # '=', '~' (approximately), '<', '<=', '>', '>=', '!='


@dataclass
class Inter:
    items: list                   # relations joined by 'and' / \cap


@dataclass
class Minus:
    """A set without some points: '\\mathbb{R} \\setminus \\{0\\}'."""
    whole: object
    removed: object


@dataclass
class Seq:
    items: list
    open: str = ""                # "(", "[", "{" (a set) or "" (a bare comma list)
    close: str = ""


@dataclass
class Union:
    items: list


@dataclass
class Matrix:
    rows: list                    # list of lists of Val


@dataclass
class Text:
    text: str


@dataclass
class Choice:
    letter: str


class _Undef:
    """Marker node: the answer contains an undefined literal (nan, zoo)."""


_PM = sympy.Symbol("__pm__")      # the sign of \pm; the parser's names can never contain '_' twice
_UNDEF_WORDS = frozenset(("nan", "zoo", "NaN"))
_FUNCS = {
    "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "sec": sympy.sec, "csc": sympy.csc,
    "cot": sympy.cot, "arcsin": sympy.asin, "arccos": sympy.acos, "arctan": sympy.atan,
    "asin": sympy.asin, "acos": sympy.acos, "atan": sympy.atan, "sinh": sympy.sinh,
    "cosh": sympy.cosh, "tanh": sympy.tanh, "exp": sympy.exp, "ln": sympy.log, "log": sympy.log,
    "sqrt": None, "abs": sympy.Abs, "cosec": sympy.csc, "arcsinh": sympy.asinh, "arccosh": sympy.acosh,
    "arctanh": sympy.atanh, "asinh": sympy.asinh, "acosh": sympy.acosh, "atanh": sympy.atanh,
    "floor": sympy.floor, "ceil": sympy.ceiling, "lg": None, "det": None,
    "sech": sympy.sech, "csch": sympy.csch, "cosech": sympy.csch, "coth": sympy.coth, "arccot": sympy.acot,
    "acot": sympy.acot, "arcsec": sympy.asec, "arccsc": sympy.acsc, "asec": sympy.asec, "acsc": sympy.acsc,
    "gcd": None, "lcm": None, "max": None, "min": None,
}
# Functions of several arguments, kept unevaluated (sympy's own Max/gcd would simplify on creation)
# and evaluated by _ev: gcd and lcm of integers, max and min of real numbers.
_NARY = {name: sympy.Function(name.upper() + "_") for name in ("gcd", "lcm", "max", "min")}
_MOD = sympy.Function("MOD_")             # a \bmod b, on integers
_SUM = sympy.Function("SUM_")             # (Lambda(k, body), lo, hi): a sum with integer bounds
_PROD = sympy.Function("PROD_")
_TRIG = frozenset(("sin", "cos", "tan", "sec", "csc", "cot"))
_INVERSE = {"sin": sympy.asin, "cos": sympy.acos, "tan": sympy.atan, "sinh": sympy.asinh,
            "cosh": sympy.acosh, "tanh": sympy.atanh}
_CONST_WORDS = {"pi": S.Pi, "infty": S.Infinity, "oo": S.Infinity, "inf": S.Infinity, "infinity": S.Infinity}
_GREEK = frozenset((
    "alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "vartheta",
    "iota", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "upsilon", "phi", "varphi",
    "chi", "psi", "omega", "Gamma", "Delta", "Theta", "Lambda", "Xi", "Pi", "Sigma", "Upsilon",
    "Phi", "Psi", "Omega", "hbar", "ell", "odot", "nabla", "partial",
))
_ACCENTS = frozenset(("dot", "ddot", "hat", "bar", "vec", "tilde", "overline", "widehat",
                      "widetilde", "overrightarrow"))
_REL_CMDS = {"le": "<=", "ge": ">=", "ne": "!=", "lt": "<", "gt": ">", "approx": "~", "equiv": "="}
_NO_FACTOR_CMDS = frozenset(("cdot", "times", "div", "pm", "mp", "le", "ge", "ne", "lt", "gt",
                             "cup", "cap", "setminus", "in", "to", "end", "right", "\\", "}", "quad", "qquad",
                             "approx", "equiv", "sim", "rangle", "rbrace", "rfloor", "rceil"))
_TRANSPOSE_RE = re.compile(r"\s*(?:\{\s*(?:T|\\top|\\intercal)\s*\}|T|\\top|\\intercal)(?![a-zA-Z])")
_MATRIX_ENVS = ("pmatrix", "bmatrix", "matrix", "smallmatrix", "Bmatrix", "vmatrix", "array")


def _neg(e):
    return sympy.Mul(S.NegativeOne, e, evaluate=False)


def _div(a, b):
    return sympy.Mul(a, sympy.Pow(b, S.NegativeOne, evaluate=False), evaluate=False)


# ------------------------------------------------------------------------------------------------
# Matrices: the determinant and entrywise algebra (sums, scalar multiples), done while parsing.

def _det(m):
    """The determinant of a square matrix node as an unevaluated sympy sum (cofactor expansion)."""
    if not isinstance(m, Matrix) or len(m.rows) != len(m.rows[0]) or len(m.rows) > MAX_DET_SIZE:
        raise _ParseError("determinant of a non-square or large matrix")

    def det(rows):
        if len(rows) == 1:
            return rows[0][0]
        terms = []
        for j, a in enumerate(rows[0]):
            minor = [r[:j] + r[j + 1:] for r in rows[1:]]
            t = sympy.Mul(a, det(minor), evaluate=False)
            terms.append(_neg(t) if j % 2 else t)
        return sympy.Add(*terms, evaluate=False)
    return det([[v.expr for v in r] for r in m.rows])


def _matrix_map(m, fn):
    """A matrix node with fn applied to every entry expression (scalar multiple, negation)."""
    return Matrix([[Val(fn(v.expr), v.inexact) for v in r] for r in m.rows])


def _matrix_add(a, b, sign):
    if not (isinstance(a, Matrix) and isinstance(b, Matrix)) or len(a.rows) != len(b.rows) or \
            len(a.rows[0]) != len(b.rows[0]):
        raise _ParseError("arithmetic on a structure")
    return Matrix([[Val(sympy.Add(x.expr, _neg(y.expr) if sign == "-" else y.expr, evaluate=False),
                        x.inexact or y.inexact) for x, y in zip(ra, rb)] for ra, rb in zip(a.rows, b.rows)])


# ------------------------------------------------------------------------------------------------
# The parser: recursive descent over the cleaned string, building sympy objects directly.
#
# The whole grammar (what _clean leaves; the table in the module docstring lists the spellings):
#
#   answer   := item ((',' | ';') item)* | item ('\cup' item)* | item ('\cap' item)*
#             | item '\setminus' item
#   item     := expr (relop expr)*          relop: = < > <= >= \le \ge \ne \approx \equiv (a chain)
#   expr     := ['+'|'-'|'\pm'] term (('+'|'-'|'\pm') term)*      matrices: entrywise sums
#   term     := factor ((op)? factor)*      op: * / : \cdot \times \div \bmod; none = implicit *
#                                          (a number times a matrix is a scalar multiple)
#   factor   := ('-'|'+') factor | atom postfix*      postfix: ^x ^T _x ! ' % °
#   atom     := number | letter | word | function | \cmd | (..) | [..] | \{..\} | {..} | |..|
#             | matrix | 'C(' n ',' k ')'
#   function := name ['^' sup] ['_' base] arg        sin cos ... ln log lg exp sqrt abs floor ceil
#             | (gcd|lcm|max|min) ('(' | '\{') expr (',' expr)* (')' | '\}') | det matrix
#   \cmd     := \frac a b | \sqrt[n] a | \binom a b | \lfloor e \rfloor | \lceil e \rceil
#             | (\sum|\prod) '_{' letter '=' expr '}' '^' sup term        (integer bounds)
#             | \text{word} | \pi | \infty | greek | accent{x} | \angle ABC | \{ \} (empty set)
#   matrix   := \begin{pmatrix|bmatrix|matrix|array|vmatrix ...} rows \end{..}   (vmatrix: det)

class _Parser:
    def __init__(self, s: str, budget: _Budget):
        self.s = s
        self.n = len(s)
        self.i = 0
        self.depth = 0
        self.budget = budget
        self.decimal = False      # a decimal literal was read in the current item
        self.literals = 0         # number literals read in the current item
        self.half_ulp = None      # half a unit in the last place of the last decimal literal
        self.least_decimal = None     # the smallest non-zero decimal literal of the current item
        self.percent = False
        self.pm = False
        self.trig_depth = 0       # > 0 while parsing the argument of sin, cos, ...
        self.bound = ()           # index letters of the enclosing sums ('i' there is not sqrt(-1))
        self.abs_depth = 0        # > 0 inside |..|, where a '|' closes instead of starting a factor
        self.split = frozenset()  # words read as products of their letters ('abc' = a*b*c)
        self.check_zero = False   # a prediction: products of a written 0 and a name raise _NotMath

    # -- low-level helpers
    def ws(self) -> None:
        s, n, i = self.s, self.n, self.i
        while i < n and s[i] in " \t\n\r":
            i += 1
        self.i = i

    def peek(self) -> str:
        self.ws()
        return self.s[self.i] if self.i < self.n else ""

    def at(self, lit: str) -> bool:
        self.ws()
        return self.s.startswith(lit, self.i)

    def eat(self, lit: str) -> bool:
        if self.at(lit):
            self.i += len(lit)
            return True
        return False

    def expect(self, lit: str) -> None:
        if not self.eat(lit):
            raise _ParseError(f"expected {lit!r} at {self.i}")

    def cmd_name(self) -> str | None:
        """Name of the command at the cursor ('frac' for '\\frac'), without consuming it."""
        self.ws()
        s, i = self.s, self.i
        if i < self.n and s[i] == "\\":
            j = i + 1
            while j < self.n and s[j].isalpha():
                j += 1
            if j == i + 1:
                return s[i + 1:i + 2]        # \{ \} \\ \,
            return s[i + 1:j]
        return None

    def take_cmd(self) -> str:
        name = self.cmd_name()
        self.i += 1 + len(name)
        return name

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Limit("nesting depth")
        self.budget.tick()

    # -- top level
    def parse_answer(self):
        items = [self.parse_item()]
        kind = None
        while True:
            if self.eat(","):
                kind = kind or ","
                if kind != ",":
                    raise _ParseError("mixed separators")
                items.append(self.parse_item())
            elif self.cmd_name() in ("cup", "cap", "setminus"):
                name = self.take_cmd()
                kind = kind or name
                if kind != name or (name == "setminus" and len(items) > 1):
                    raise _ParseError("mixed separators")
                items.append(self.parse_item())
            elif self.eat(";"):
                kind = kind or ","
                items.append(self.parse_item())
            else:
                break
        if self.peek():
            raise _ParseError(f"trailing input at {self.i}")
        if kind == "cup":
            return Union(items)
        if kind == "cap":
            return Inter(items)
        if kind == "setminus":
            return Minus(items[0], items[1])
        if len(items) == 1:
            return items[0]
        return Seq(items)

    def parse_item(self):
        """One value: an expression, a relation or chain of relations, a bracketed tuple/interval/set
        or a matrix. A name in front of a structure ('(a,b) = (4,1)', 'v = pmatrix') is dropped."""
        saved = (self.decimal, self.percent, self.pm, self.literals, self.half_ulp, self.least_decimal)
        any_decimal = False
        try:
            parts, ops = [], []
            while True:
                self.decimal = self.percent = self.pm = False
                self.literals, self.half_ulp, self.least_decimal = 0, None, None
                e = self.parse_expr()
                any_decimal = any_decimal or self.decimal
                if isinstance(e, (Seq, Matrix, _Undef)):
                    parts.append(e)
                else:
                    val = Val(e, self.decimal, self.percent, least_decimal=self.least_decimal)
                    if self.literals == 1 and self.half_ulp is not None and (
                            isinstance(e, sympy.Rational) or (isinstance(e, sympy.Mul) and len(
                                e.args) == 2 and e.args[0] == -1 and e.args[1].is_Rational)):
                        val.half_ulp = self.half_ulp
                    parts.append(val)
                op = self._relop()
                if op is None:
                    break
                ops.append(op)
                if len(ops) > 8:
                    raise _ParseError("long chain")
            if not ops:
                return parts[0]
            if any(isinstance(p, _Undef) for p in parts):
                return _Undef()
            if len(parts) == 2 and ops[0] == "=" and isinstance(parts[1], (Seq, Matrix)) and (
                    _is_name(parts[0].expr) if isinstance(parts[0], Val) else
                    isinstance(parts[0], Seq) and all(isinstance(x, Val) and _is_name(x.expr)
                                                      for x in parts[0].items)):
                return parts[1]             # departure 17: a named structure is the structure
            if any(not isinstance(p, Val) for p in parts):
                raise _ParseError("relation on a structure")
            if len(ops) == 1 and ops[0] != "~":
                return Eqn(parts[0], parts[1], ops[0])
            return Chain(parts, ops)
        finally:
            self.decimal = saved[0] or any_decimal
            self.percent, self.pm, self.literals, self.half_ulp, self.least_decimal = saved[1:]

    def _relop(self) -> str | None:
        c = self.peek()
        if c == "=":
            self.i += 1
            return "="
        if c in ("<", ">"):
            self.i += 1
            return c + ("=" if self.eat("=") else "")
        if c == "\\" and self.cmd_name() in _REL_CMDS:
            return _REL_CMDS[self.take_cmd()]
        return None

    # -- arithmetic
    def parse_expr(self):
        self.enter()
        try:
            terms = []
            sign = None
            c = self.peek()
            if c in ("+", "-"):
                self.i += 1
                sign = c
            elif self.cmd_name() in ("pm", "mp"):
                sign = self.take_cmd()
            t = self.parse_term()
            if sign == "-" and type(t) is _MOD:
                t, sign = _MOD(_neg(t.args[0]), t.args[1]), None    # '-3 \\bmod 4' is 1, not -(3 mod 4)
            if isinstance(t, Matrix) and sign in (None, "+", "-"):
                return self._matrix_sum(_matrix_map(t, _neg) if sign == "-" else t)
            if isinstance(t, (Seq, Matrix, _Undef)):
                if sign is not None or self.peek() in ("+", "-"):
                    raise _ParseError("arithmetic on a structure")
                return t
            terms.append(self._signed(t, sign))
            while True:
                c = self.peek()
                if c in ("+", "-"):
                    self.i += 1
                    sign = c
                elif c == "\\" and self.cmd_name() in ("pm", "mp"):
                    sign = self.take_cmd()
                else:
                    break
                t = self.parse_term()
                if isinstance(t, (Seq, Matrix, _Undef)):
                    raise _ParseError("arithmetic on a structure")
                terms.append(self._signed(t, sign))
            return terms[0] if len(terms) == 1 else sympy.Add(*terms, evaluate=False)
        finally:
            self.depth -= 1

    def _matrix_sum(self, m):
        """'A + B - C' of matrices of one shape: entrywise."""
        while self.peek() in ("+", "-"):
            op = self.s[self.i]
            self.i += 1
            m = _matrix_add(m, self.parse_term(), op)
        return m

    def _signed(self, t, sign):
        if sign == "-":
            return _neg(t)
        if sign in ("pm", "mp"):
            self.pm = True
            pm = _PM if sign == "pm" else _neg(_PM)
            return sympy.Mul(pm, t, evaluate=False)
        return t

    def starts_factor(self) -> bool:
        c = self.peek()
        if not c:
            return False
        if c.isdigit() or c.isalpha() or c in ("(", "{", "[", "."):
            return True
        if c == "|":                # '|a|\,|b|', '2|a|': a '|' starts a factor unless it closes one
            return self.abs_depth == 0
        if c == "\\":
            name = self.cmd_name()
            return name not in _NO_FACTOR_CMDS and name not in _REL_CMDS and name != "}"
        return False

    def _written_zero(self, e, start: int) -> bool:
        """e was written as the literal 0: '0', '(0)', '{0}' (not '000' of '2,000 km')."""
        return e is S.Zero and self.s[start:self.i].strip(" {}()") == "0"

    def parse_term(self):
        self.ws()
        start = self.i
        f = self.parse_factor()
        zero = self._written_zero(f, start)
        if isinstance(f, (Seq, _Undef)) or (isinstance(f, Matrix) and not self.starts_factor()):
            return f
        factors = [f]
        first_int = self._is_int_literal(f)
        ratio = False
        while True:
            c = self.peek()
            op = "*"
            implicit = False
            if c == "*" and not self.s.startswith("**", self.i):
                self.i += 1
            elif c in ("/", ":"):         # a ratio 3:5 is the number 3/5
                if c == ":" and (ratio or re.compile(r":\s*\d\d(?!\d)").match(self.s, self.i)):
                    raise _ParseError("clock time or ratio of three")  # 05:00, 1:2:3: compared as text
                ratio = ratio or c == ":"
                self.i += 1
                op = "/"
            elif c == "\\" and self.cmd_name() in ("cdot", "times", "ast"):
                self.take_cmd()
            elif c == "\\" and self.cmd_name() == "div":
                self.take_cmd()
                op = "/"
            elif c == "\\" and self.cmd_name() in ("bmod", "mod"):     # 17 \bmod 5
                self.take_cmd()
                g = self.parse_factor()
                if isinstance(g, (Seq, Matrix, _Undef)):
                    raise _ParseError("arithmetic on a structure")
                left = factors[0] if len(factors) == 1 else sympy.Mul(*factors, evaluate=False)
                factors = [_MOD(left, g)]
                continue
            elif not self.starts_factor():
                break
            elif (len(factors) == 1 and first_int and self.cmd_name() == "frac"):
                mixed = self._try_mixed(factors[0])
                if mixed is not None:
                    factors[0] = mixed
                    continue
            else:
                implicit = True
            if implicit and (c.isdigit() or c == ".") and self.s[:self.i].rstrip()[-1:].isdigit() and not (
                    re.search(r"\^\s*\d\s*$", self.s[:self.i]) and re.match(r"\d+\s*\^", self.s[self.i:])):
                raise _ParseError("numbers side by side")     # '7 0', '4 5': not a product (nor 10 000)
            start = self.i
            g = self.parse_factor()
            zero = zero or self._written_zero(g, start)
            if isinstance(g, (Seq, _Undef)) or (isinstance(g, Matrix) and op == "/"):
                raise _ParseError("arithmetic on a structure")
            factors.append(_div(S.One, g) if op == "/" else g)
        if len(factors) == 1:
            return factors[0]
        if self.check_zero:
            _check_product([x for x in factors if not isinstance(x, Matrix)], zero)
        mats = [x for x in factors if isinstance(x, Matrix)]
        if mats:                      # a scalar multiple '2 A', '\frac12 A' (no matrix products)
            if len(mats) > 1:
                raise _ParseError("matrix product")
            scalar = [x for x in factors if not isinstance(x, Matrix)]
            k = scalar[0] if len(scalar) == 1 else sympy.Mul(*scalar, evaluate=False)
            return _matrix_map(mats[0], lambda e: sympy.Mul(k, e, evaluate=False))
        return sympy.Mul(*factors, evaluate=False)

    @staticmethod
    def _is_int_literal(e) -> bool:
        return isinstance(e, sympy.Integer) and e >= 0

    def _try_mixed(self, whole):
        """'1\\frac{4}{5}' is 1 + 4/5 when both parts of the fraction are integer literals."""
        save = self.i
        self.take_cmd()
        a, b = self.parse_arg(), self.parse_arg()
        if isinstance(a, sympy.Integer) and isinstance(b, sympy.Integer) and b != 0:
            return sympy.Add(whole, _div(a, b), evaluate=False)
        self.i = save
        return None

    def parse_factor(self):
        self.enter()
        try:
            c = self.peek()
            if c == "-":
                self.i += 1
                f = self.parse_factor()
                if isinstance(f, Matrix):
                    return _matrix_map(f, _neg)
                if isinstance(f, (Seq, _Undef)):
                    raise _ParseError("sign on a structure")
                return _neg(f)
            if c == "+":
                self.i += 1
                return self.parse_factor()
            base = self.parse_atom()
            return self.parse_postfix(base)
        finally:
            self.depth -= 1

    def parse_postfix(self, base):
        while True:
            c = self.peek()
            if c == "^" or (c == "*" and self.s.startswith("**", self.i)):
                plain = c == "*"
                self.i += 2 if plain else 1
                t = _TRANSPOSE_RE.match(self.s, self.i)
                if isinstance(base, Matrix) and t:          # A^T, A^{\top}
                    self.i = t.end()
                    base = Matrix([list(col) for col in zip(*base.rows)])
                    continue
                if isinstance(base, (Seq, Matrix, _Undef)):
                    raise _ParseError("power of a structure")
                if self.cmd_name() == "prime":
                    self.take_cmd()
                    base = sympy.Symbol(_name_of(base) + "'") if base.is_Symbol else \
                        sympy.Mul(base, sympy.Symbol("'"), evaluate=False)
                    continue
                exp = self.parse_factor() if plain else self.parse_sup()
                if isinstance(exp, (Seq, Matrix, _Undef)):
                    raise _ParseError("structure exponent")
                base = sympy.Pow(base, exp, evaluate=False)
            elif c == "_":
                self.i += 1
                sub = self.parse_sub_text()
                if isinstance(base, sympy.Integer):
                    if not _BASE_RE.fullmatch(sub):
                        raise _ParseError("subscript on a number that is not a base")   # 4_{\text{or }5}
                    continue        # base subscript of a number: 52_8 compares as 52 (departure 6)
                if isinstance(base, sympy.Symbol):
                    base = sympy.Symbol(base.name + "_" + sub)
                    continue
                raise _ParseError("subscript on an expression")
            elif c == "!":
                self.i += 1
                if isinstance(base, (Seq, Matrix, _Undef)):
                    raise _ParseError("factorial of a structure")
                base = sympy.factorial(base, evaluate=False)
            elif c == "'":
                self.i += 1
                if isinstance(base, sympy.Symbol):
                    base = sympy.Symbol(base.name + "'")
                else:
                    raise _ParseError("prime on an expression")
            elif c == "%":
                self.i += 1
                self.percent = True
            elif c == "°":
                self.i += 1             # degrees: radians inside a trig function, else dropped (dep. 5)
                if self.trig_depth and not isinstance(base, (Seq, Matrix, _Undef)):
                    base = sympy.Mul(base, _div(S.Pi, sympy.Integer(180)), evaluate=False)
            else:
                return base

    def parse_sup(self):
        """The exponent after '^': a {group}, a number, a command or a single letter."""
        c = self.peek()
        if c == "{":
            return self.parse_group()
        if c.isdigit():
            return self.parse_number()
        if c in ("+", "-"):
            self.i += 1
            e = self.parse_sup()
            return _neg(e) if c == "-" else e
        if c.isalpha():
            self.i += 1
            return self._letter(c)
        return self.parse_atom()

    def parse_sub_text(self) -> str:
        """A subscript as a canonical name: 'x_{0}', 'M_{\\odot}', 'lambda_{\\text{red}}'."""
        c = self.peek()
        if c == "{":
            end = _match_brace(self.s, self.i)
            if end < 0:
                raise _ParseError("unclosed subscript")
            raw = self.s[self.i + 1:end]
            self.i = end + 1
        elif c == "\\":
            raw = self.take_cmd()
        elif c:
            raw = c
            self.i += 1
        else:
            raise _ParseError("empty subscript")
        raw = re.sub(r"\\text|[{}\\\s]", "", raw)
        if not raw or len(raw) > 40:
            raise _ParseError("bad subscript")
        return raw

    def parse_group(self):
        self.expect("{")
        e = self.parse_expr()
        self.expect("}")
        return e

    def parse_arg(self):
        """A command argument: {group} or one token (\\frac43 -> 4, 3; \\sqrt2)."""
        c = self.peek()
        if c == "{":
            return self.parse_group()
        if c.isdigit():
            self.i += 1
            return sympy.Integer(int(c))
        if c.isalpha():
            self.i += 1
            return self._letter(c)
        if c == "\\":
            return self.parse_atom()
        raise _ParseError("missing argument")

    def parse_number(self):
        m = re.compile(r"\d*\.?\d*(?:[eE][+-]?\d+)?").match(self.s, self.i)
        txt = m.group(0) if m else ""
        mant = re.match(r"\d*\.?\d*", txt).group(0)
        if not mant.strip(".") or len(txt) > MAX_INT_DIGITS:
            raise _ParseError("bad number")
        # "2e^{x}" or "3e" is 3*e, not scientific notation: the exponent needs digits right after.
        self.i += len(txt)
        value = _decimal_fraction(mant)
        self.literals += 1
        places = len(mant) - mant.index(".") - 1 if "." in mant else 0
        if "." in mant:
            self.decimal = True
            self.half_ulp = Fraction(1, 2 * 10 ** places)
        if len(txt) > len(mant):
            expo = int(txt[len(mant) + 1:])
            if abs(expo) > MAX_POW_EXP:
                raise _Limit("scientific exponent")
            self.decimal = True
            value *= Fraction(10) ** expo
            self.half_ulp = Fraction(1, 2 * 10 ** places) * Fraction(10) ** expo
        if self.decimal and value and (self.least_decimal is None or value < self.least_decimal):
            self.least_decimal = value
        return sympy.Rational(value.numerator, value.denominator)

    def _letter(self, ch: str):
        if ch in self.bound:
            return sympy.Symbol(ch)
        if ch == "e":
            return S.Exp1
        if ch == "i":
            return S.ImaginaryUnit
        return sympy.Symbol(ch)

    def parse_letters(self):
        j = self.i
        while j < self.n and self.s[j].isalpha() and self.s[j].isascii():
            j += 1
        run = self.s[self.i:j]
        if not run:
            raise _ParseError(f"unexpected character {self.s[self.i]!r}")
        self.i = j
        if run in _UNDEF_WORDS:
            return _Undef()
        if run in _CONST_WORDS:
            return _CONST_WORDS[run]
        if run in _FUNCS:
            return self.parse_function(run)
        if len(run) >= 3 and run not in self.split:
            return sympy.Symbol(run)       # a word: SRMC, east (departure 10)
        if run == "C" and self.s.startswith("(", j):     # C(6, 2): the binomial coefficient
            got = self._try_choose()
            if got is not None:
                return got
        if len(run) == 1 and run not in "ei" and run not in self.bound:
            m = _FN_VALUE_RE.match(self.s, j)
            if m:                          # I(0), y(1): a function's value is one symbol, not I*0
                self.i = m.end()
                return sympy.Symbol(run + m.group(0))
        self.i = j - len(run) + 1          # one letter: the next is another factor ('xy^2' is x*y^2)
        return self._letter(run[0])

    def _try_choose(self):
        """'C(n, k)' with integer literals n >= k >= 0 is \\binom{n}{k}; anything else is C times (..)."""
        m = re.compile(r"\(\s*(\d{1,4})\s*,\s*(\d{1,4})\s*\)").match(self.s, self.i)
        if not m or int(m.group(2)) > int(m.group(1)):
            return None
        self.i = m.end()
        return sympy.binomial(sympy.Integer(int(m.group(1))), sympy.Integer(int(m.group(2))), evaluate=False)

    def parse_function(self, name: str):
        if name in _NARY:
            return _NARY[name](*self.parse_fn_list())
        if name == "det":
            return _det(self.parse_atom())
        power = None
        if self.eat("^"):
            power = self.parse_sup()
        base = None
        if name == "log" and self.eat("_"):
            c = self.peek()
            base = self.parse_group() if c == "{" else self.parse_arg()
        c = self.peek()
        trig = name in _TRIG
        self.trig_depth += trig
        try:
            if c in ("(", "{", "["):
                arg = self.parse_atom()
            else:
                arg = self.parse_fn_arg()
        finally:
            self.trig_depth -= trig
        if isinstance(arg, (Seq, Matrix, _Undef)):
            raise _ParseError("function of a structure")
        if name == "sqrt":
            out = sympy.Pow(arg, S.Half, evaluate=False)
        elif name == "lg":
            base = sympy.Integer(10)
            out = _div(sympy.log(arg, evaluate=False), sympy.log(base, evaluate=False))
        elif name in ("log", "ln") and base is not None:
            out = _div(sympy.log(arg, evaluate=False), sympy.log(base, evaluate=False))
        else:
            out = _FUNCS[name](arg, evaluate=False)
        if power is not None and name in _INVERSE and not power.free_symbols and \
                _ev(power, {}, self.budget) == -1:
            return _INVERSE[name](arg, evaluate=False)      # \sin^{-1} x is arcsin x
        if power is not None:
            out = sympy.Pow(out, power, evaluate=False)
        return out

    def parse_fn_list(self) -> list:
        """The arguments of \\gcd(a, b), \\max\\{a, b, c\\}: expressions in ( ) or \\{ \\}."""
        if self.eat("("):
            closer = ")"
        elif self.eat("["):
            closer = "]"
        elif self.eat("\\{"):
            closer = "\\}"
        else:
            raise _ParseError("function without its argument list")
        args = [self.parse_expr()]
        while self.eat(",") or self.eat(";"):
            args.append(self.parse_expr())
        self.expect(closer)
        if any(isinstance(a, (Seq, Matrix, _Undef)) for a in args) or len(args) > 64:
            raise _ParseError("bad argument list")
        return args

    def parse_fn_arg(self):
        """'\\sin 2x' -> sin(2x): factors up to the next operator or function (no parens)."""
        self.ws()
        start = self.i
        factors = [self.parse_factor()]
        zero = self._written_zero(factors[0], start)
        while self.starts_factor():
            name = self.cmd_name()
            if name in _FUNCS or name == "frac":
                break
            if self.peek().isalpha():
                j = self.i
                while j < self.n and self.s[j].isalpha():
                    j += 1
                if self.s[self.i:j] in _FUNCS:
                    break
            start = self.i
            factors.append(self.parse_factor())
            zero = zero or self._written_zero(factors[-1], start)
        if any(isinstance(f, (Seq, Matrix, _Undef)) for f in factors):
            raise _ParseError("function of a structure")
        if len(factors) > 1 and self.check_zero:
            _check_product(factors, zero)          # '\\sin 0x'
        return factors[0] if len(factors) == 1 else sympy.Mul(*factors, evaluate=False)

    def parse_atom(self):
        self.budget.tick()
        c = self.peek()
        if not c:
            raise _ParseError("unexpected end")
        if c.isdigit() or (c == "." and self.s[self.i + 1:self.i + 2].isdigit()):
            return self.parse_number()
        if c.isalpha():
            return self.parse_letters()
        if c in ("(", "["):
            return self.parse_bracket()
        if c == "{":                    # {x+1} is a group; {2, 7} is a set written without backslashes
            self.i += 1
            items = [self.parse_item()]
            while self.eat(","):
                items.append(self.parse_item())
            self.expect("}")
            if len(items) > 1:
                return Seq(items, "{", "}")
            it = items[0]
            if isinstance(it, Val):
                self.percent = self.percent or it.percent
                return it.expr
            if isinstance(it, (Seq, Matrix)):
                return it
            raise _ParseError("relation in a group")
        if c == "|":
            self.i += 1
            self.abs_depth += 1
            try:
                e = self.parse_expr()
            finally:
                self.abs_depth -= 1
            self.expect("|")
            if isinstance(e, (Seq, Matrix, _Undef)):
                raise _ParseError("absolute value of a structure")
            return sympy.Abs(e, evaluate=False)
        if c == "\\":
            return self.parse_command()
        raise _ParseError(f"unexpected character {c!r}")

    def parse_bracket(self):
        """(..), [..]: a group when it holds one item, else a tuple/interval with its bracket kinds."""
        opener = self.s[self.i]
        self.i += 1
        items = [self.parse_item()]
        while self.eat(",") or self.eat(";"):
            items.append(self.parse_item())
        c = self.peek()
        if c not in (")", "]"):
            raise _ParseError("unclosed bracket")
        self.i += 1
        if len(items) == 1 and (opener + c) in ("()", "[]"):
            it = items[0]
            if isinstance(it, Val) and not it.percent:
                return it.expr
            if isinstance(it, (Seq, Matrix)):
                return it
            raise _ParseError("bracketed relation")
        return Seq(items, opener, c)

    def parse_command(self):
        name = self.take_cmd()
        if name == "frac":
            start = self.i
            a = self.parse_arg()
            zero = self._written_zero(a, start)
            b = self.parse_arg()
            if self.check_zero:
                _check_product([a, b], zero)
            return _div(a, b)
        if name == "sqrt":
            if self.eat("["):
                idx = self.parse_expr()
                self.expect("]")
                arg = self.parse_arg()
                return sympy.Pow(arg, _div(S.One, idx), evaluate=False)
            return sympy.Pow(self.parse_arg(), S.Half, evaluate=False)
        if name == "binom":
            n, k = self.parse_arg(), self.parse_arg()
            return sympy.binomial(n, k, evaluate=False)
        if name in ("sum", "prod"):
            return self.parse_big_operator(name)
        if name in ("pi", "infty", "infinity"):
            return _CONST_WORDS[name]
        if name in _FUNCS:
            return self.parse_function(name)
        if name in ("exp",):
            return self.parse_function(name)
        if name == "{" and self.at("\\}"):
            self.expect("\\}")
            return Seq([], "{", "}")      # the empty set
        if name in ("angle", "measuredangle"):
            m = re.compile(r"\s*([A-Za-z]{1,4})").match(self.s, self.i)
            if not m:
                raise _ParseError("angle without a name")
            self.i = m.end()
            return sympy.Symbol("angle_" + m.group(1))
        if name == "{":
            items = [self.parse_item()]
            while self.eat(","):
                items.append(self.parse_item())
            self.expect("\\}")
            return Seq(items, "{", "}")
        if name in ("lfloor", "lceil"):
            e = self.parse_expr()
            closer = "rfloor" if name == "lfloor" else "rceil"
            if self.cmd_name() != closer:
                raise _ParseError("unclosed floor/ceil")
            self.take_cmd()
            fn = sympy.floor if name == "lfloor" else sympy.ceiling
            return fn(e, evaluate=False)
        if name == "text":
            end = _match_brace(self.s, self.i) if self.peek() == "{" else -1
            if end < 0:
                raise _ParseError("bad \\text")
            raw = self.s[self.i + 1:end].strip()
            self.i = end + 1
            if re.fullmatch(r"[A-Za-z]+", raw):
                return sympy.Symbol(raw) if len(raw) > 1 else self._letter(raw)
            raise _ParseError("text inside math")
        if name in _ACCENTS:
            arg = self.parse_arg()
            if isinstance(arg, sympy.Symbol):
                return sympy.Symbol(f"{name}({arg.name})")
            raise _ParseError("accent on an expression")
        if name == "begin":
            return self.parse_matrix()
        if name in _GREEK:
            return sympy.Symbol(name)
        if name in ("cdots", "ldots", "dots"):
            raise _ParseError("ellipsis")
        raise _ParseError(f"unknown command \\{name}")

    def parse_big_operator(self, name: str):
        """'\\sum_{k=1}^{4} k^2', '\\prod_{i=1}^{3}(x+i)': integer bounds, the body is the next term.
        Kept as SUM_/PROD_(Lambda(k, body), lo, hi), expanded only when evaluated."""
        self.expect("_")
        m = re.compile(r"\s*\{\s*([a-zA-Z])\s*=\s*").match(self.s, self.i)
        if not m:
            raise _ParseError("sum without 'k ='")
        self.i = m.end()
        var = m.group(1)
        lo = self.parse_expr()
        self.expect("}")
        self.expect("^")
        hi = self.parse_sup()
        saved, self.bound = self.bound, self.bound + (var,)
        try:
            body = self.parse_term()
        finally:
            self.bound = saved
        if any(isinstance(x, (Seq, Matrix, _Undef)) for x in (lo, hi, body)):
            raise _ParseError("sum of a structure")
        k = sympy.Symbol(var)
        return (_SUM if name == "sum" else _PROD)(sympy.Lambda(k, body), lo, hi)

    def parse_matrix(self):
        env_m = re.compile(r"\s*\{(\w+)\}").match(self.s, self.i)
        if not env_m or env_m.group(1) not in _MATRIX_ENVS:
            raise _ParseError("unknown environment")
        env = env_m.group(1)
        self.i = env_m.end()
        if env == "array":          # skip the column spec {cc}
            spec = re.compile(r"\s*\{[^{}]*\}").match(self.s, self.i)
            if spec:
                self.i = spec.end()
        rows, row = [], []
        while True:
            item = self.parse_item()
            if not isinstance(item, Val):
                raise _ParseError("matrix entry")
            row.append(item)
            if self.eat("&"):
                continue
            if self.eat("\\\\"):
                rows.append(row)
                row = []
                if self.cmd_name() == "end":
                    break
                continue
            if self.cmd_name() == "end":
                rows.append(row)
                break
            raise _ParseError("bad matrix")
        self.take_cmd()
        end_m = re.compile(r"\s*\{(\w+)\}").match(self.s, self.i)
        if not end_m or end_m.group(1) != env:
            raise _ParseError("bad \\end")
        self.i = end_m.end()
        if any(len(r) != len(rows[0]) for r in rows):
            raise _ParseError("ragged matrix")
        if env == "vmatrix":
            return _det(Matrix(rows))
        return Matrix(rows)


def _is_name(e) -> bool:
    """A left side that names the answer: symbols only, no number (x, AB, |PQ|, x+y, A:B, P(A)).
    '2x' or 'x^2' is not a name: '2x = 10' is an equation, not the answer 10."""
    if not getattr(e, "free_symbols", None) or _PM in e.free_symbols:
        return False
    return _symbols_only(e, 0) and len(e.atoms(sympy.Symbol)) == _count_symbols(e, 0)   # not 'x - x'


def _count_symbols(e, depth: int) -> int:
    """Occurrences of symbols in e, repeats counted."""
    if e.is_Symbol:
        return 1
    return sum(_count_symbols(a, depth + 1) for a in e.args) if depth < 30 else 10 ** 6


def _symbols_only(e, depth: int) -> bool:
    if depth > 30:
        return False
    if e.is_Symbol or e is S.NegativeOne:
        return True
    if isinstance(e, sympy.Mul):            # x*y, -x, A*(1/B)
        return all(a is S.One or _symbols_only(a, depth + 1) for a in e.args)
    if isinstance(e, sympy.Pow):            # only the 1/B of a division
        return e.exp is S.NegativeOne and _symbols_only(e.base, depth + 1)
    if isinstance(e, (sympy.Add, sympy.Abs)):
        return all(_symbols_only(a, depth + 1) for a in e.args)
    return False


def _name_of(e) -> str:
    return e.name if isinstance(e, sympy.Symbol) else str(type(e).__name__)


def _decimal_fraction(txt: str) -> Fraction:
    if "." in txt:
        whole, frac = txt.split(".", 1)
        num = int(whole or "0") * 10 ** len(frac) + int(frac or "0")
        return Fraction(num, 10 ** len(frac))
    return Fraction(int(txt))


_CHOICE_RE = re.compile(r"^\(?\s*([A-E])\s*\)?$")
_CHOICE_PRED_RE = re.compile(r"^(?:\\text\{)?\(([A-E])\)")
# After a choice letter only its value may follow ('\\textbf{(C)} 12'): not '(C) or (D)', '(C)+1'.
_CHOICE_VALUE_RE = re.compile(r"[\s}]*(?:-?\d+(?:\.\d+)?|\\frac\s*\{\d+\}\s*\{\d+\}|\\sqrt\s*\{?\d+\}?)?\s*")
_WORDS_RE = re.compile(r"^[A-Za-z]{2,}(?:[ '\-]+[A-Za-z]{2,})*$")


def _unwrap_text(s: str) -> str:
    m = re.fullmatch(r"\\text\s*\{(.*)\}", s, re.DOTALL)
    if m and _match_brace(s, s.index("{")) == len(s) - 1:
        return m.group(1).strip()
    return s


def _parse(s: str, budget: _Budget, *, as_gold: bool, split: frozenset = frozenset()):
    """Cleaned answer string -> structure. Raises _ParseError / _Limit. The words in split are read
    as products of their letters (see _word_products)."""
    s = _unwrap_text(s)
    m = _CHOICE_RE.match(s)
    if m and (as_gold or s.startswith("(")):
        return Choice(m.group(1))
    if not as_gold:
        m = _CHOICE_PRED_RE.match(s)
        if m and _CHOICE_VALUE_RE.fullmatch(s[m.end():]):
            return Choice(m.group(1))       # '\\textbf{(C)} 12', not '(C) or (D)' 
    if not as_gold:
        _check_math(s)
    if _WORDS_RE.match(s) and _is_plain_words(s) and s not in split:
        return Text(_norm_text(s))
    parser = _Parser(s, budget)
    parser.split, parser.check_zero = split, not as_gold
    node = parser.parse_answer()
    return node


def _word_products(s: str, other) -> frozenset:
    """The words of s (runs of three or more letters, one symbol by departure 10) whose letters are
    all single-letter symbols of the other answer: 'abc' against 'ab c' is the product a*b*c."""
    if not isinstance(other, (Val, Eqn, Seq, Chain)):
        return frozenset()
    names = set()
    for v in _vals_of(other):
        names |= _free_names(v.expr)
    bare = re.sub(r"\\[A-Za-z]+", " ", re.sub(r"\\text\s*\{[^{}]*\}", " ", s))
    words = set(re.findall(r"(?<![A-Za-z\\])[A-Za-z]{3,6}(?![A-Za-z])", bare)) - names
    return frozenset(w for w in words if w not in _FUNCS and w not in _CONST_WORDS and w not in _UNIT_WORDS
                     and set(w) <= names)


def _vals_of(node) -> list:
    if isinstance(node, Val):
        return [node]
    if isinstance(node, Eqn):
        return [node.lhs, node.rhs]
    if isinstance(node, Chain):
        return list(node.parts)
    if isinstance(node, Seq):
        return [v for x in node.items for v in _vals_of(x)]
    return []


def _is_plain_words(s: str) -> bool:
    words = re.split(r"[\s'\-]+", s)
    if len(words) == 1:
        w = words[0]
        return len(w) >= 3 and w not in _FUNCS and w not in _CONST_WORDS and w not in _UNDEF_WORDS
    return True


def _norm_text(s: str) -> str:
    s = re.sub(r"\\text\s*\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"(?<=\d)(?:(\s+)|\.)(?=\d)", lambda m: "_" if m.group(1) else "p", s)   # '4 2' is not '42'
    return re.sub(r"[\s{}\\.]+", "", s).lower()


# ------------------------------------------------------------------------------------------------
# Numeric evaluation of sympy trees: exact Fractions when possible, else 50-digit mpmath.
# Every operation is bounded: exact values are capped in bits, float values in magnitude.

_MPF_FUNCS = {
    sympy.sin: _MP.sin, sympy.cos: _MP.cos, sympy.tan: _MP.tan, sympy.sec: _MP.sec,
    sympy.csc: _MP.csc, sympy.cot: _MP.cot, sympy.asin: _MP.asin, sympy.acos: _MP.acos,
    sympy.atan: _MP.atan, sympy.sinh: _MP.sinh, sympy.cosh: _MP.cosh, sympy.tanh: _MP.tanh,
    sympy.exp: _MP.exp, sympy.log: _MP.log, sympy.asinh: _MP.asinh, sympy.acosh: _MP.acosh,
    sympy.atanh: _MP.atanh, sympy.sech: _MP.sech, sympy.csch: _MP.csch, sympy.coth: _MP.coth,
    sympy.acot: _MP.acot, sympy.asec: _MP.asec, sympy.acsc: _MP.acsc,
}


_PERIODIC = (sympy.sin, sympy.cos, sympy.tan, sympy.sec, sympy.csc, sympy.cot)


def _to_mp(v):
    if isinstance(v, Fraction):
        return _MP.mpf(v.numerator) / v.denominator
    return v


def _check_mp(v):
    if _MP.isnan(v):
        raise _Undefined()
    if not _MP.isinf(v) and v != 0 and _MP.mag(v) > MAX_MAG_BITS:
        raise _Limit("magnitude")
    return v


def _exact_ok(v: Fraction) -> bool:
    return v.numerator.bit_length() + v.denominator.bit_length() <= MAX_EXACT_BITS


def _ev(e, env: dict, budget: _Budget):
    """Value of sympy expression e at the symbol values env: Fraction (exact) or mpc."""
    budget.tick()
    if isinstance(e, sympy.Rational):
        return Fraction(int(e.p), int(e.q))
    if isinstance(e, sympy.Symbol):
        v = env.get(e.name)
        if v is None:           # only the +- sign can be unset (a \pm inside a tuple)
            raise _Undefined()
        return v
    if isinstance(e, sympy.Add):
        # Exact terms are summed exactly and the rest at 50 digits, then joined: an exact part too small to
        # show beside the rest ('\\pi + 10^{-60}') is a limit hit, never the rest alone.
        exact, rest, big = Fraction(0), None, 0
        for a in e.args:
            v = _ev(a, env, budget)
            if isinstance(v, Fraction):
                exact += v
                if _exact_ok(exact):
                    continue
                v, exact = _to_mp(exact), Fraction(0)
            big = max(big, abs(v))
            rest = v if rest is None else _check_mp(rest + v)
        if rest is None:
            return exact
        budget.scale = max(budget.scale, big, abs(_to_mp(exact)))
        if exact:
            if abs(_to_mp(exact)) < _TINY_MP * big:
                raise _Limit("an exact term below the working precision beside the others")
            _carried(exact)
        return _check_mp(rest + _to_mp(exact))
    if isinstance(e, sympy.Mul):
        acc = Fraction(1)
        for a in e.args:
            v = _ev(a, env, budget)
            if isinstance(acc, Fraction) and isinstance(v, Fraction):
                acc *= v
                if not _exact_ok(acc):
                    acc = _to_mp(acc)
            else:
                acc = _check_mp(_to_mp(_carried(acc)) * _to_mp(_carried(v)))
        return acc
    if isinstance(e, sympy.Pow):
        b, x = _ev(e.base, env, budget), _ev(e.exp, env, budget)
        return _note_complex(_pow(b, x), (b, x), budget)
    if e is S.Pi:
        return _MP.pi + 0
    if e is S.Exp1:
        return _MP.e + 0
    if e is S.ImaginaryUnit:
        return _MP.mpc(0, 1)
    if e is S.Infinity:
        return _MP.inf
    if e is S.NegativeInfinity:
        return -_MP.inf
    if e is S.NaN or e is S.ComplexInfinity:
        raise _Undefined()
    if isinstance(e, sympy.Abs):
        v = _ev(e.args[0], env, budget)
        return abs(v)
    if isinstance(e, (sympy.floor, sympy.ceiling)):
        v = _ev(e.args[0], env, budget)
        if not isinstance(v, Fraction):
            if abs(v.imag) > 0:
                raise _Undefined()
            v = v.real
            r = _MP.floor(v) if isinstance(e, sympy.floor) else _MP.ceil(v)
            return Fraction(int(r))
        return Fraction(math.floor(v) if isinstance(e, sympy.floor) else math.ceil(v))
    if isinstance(e, sympy.factorial):
        v = _ev(e.args[0], env, budget)
        if isinstance(v, Fraction) and v.denominator == 1 and 0 <= v <= MAX_FACTORIAL:
            return Fraction(math.factorial(int(v)))
        return _gamma_of(lambda x: _MP.gamma(x + 1), v)   # m! at a symbol's non-integer sample point
    if isinstance(e, sympy.binomial):
        n, k = (_ev(a, env, budget) for a in e.args)
        if all(isinstance(x, Fraction) and x.denominator == 1 for x in (n, k)) \
                and 0 <= n <= 10 * MAX_FACTORIAL:
            return Fraction(math.comb(int(n), int(k)) if k >= 0 else 0)
        if all(isinstance(x, Fraction) and x.denominator == 1 for x in (n, k)):
            raise _Limit("binomial")
        return _gamma_of(lambda x: _MP.binomial(x, _to_mp(k)), n, k)
    if isinstance(e, sympy.Lambda):
        raise _ParseError("a bound variable outside its sum")
    if type(e) in (_SUM, _PROD):
        return _ev_big_operator(e, env, budget)
    if type(e) in _NARY_EVAL:
        return _NARY_EVAL[type(e)]([_ev(a, env, budget) for a in e.args])
    if type(e) is _MOD:
        a, m = (_ev(x, env, budget) for x in e.args)
        if not all(isinstance(x, Fraction) and x.denominator == 1 for x in (a, m)) or m == 0:
            raise _Undefined()
        return a % m
    fn = _MPF_FUNCS.get(type(e))
    if fn is not None:
        args = [_to_mp(_carried(_ev(a, env, budget))) for a in e.args]
        if type(e) is sympy.log and args[0] == 0:
            raise _Undefined()
        if type(e) in _PERIODIC:
            budget.scale = max(budget.scale, abs(args[0]))
        try:
            v = _check_mp(fn(*args))
            return _note_complex(_tiny_check(v) if type(e) is sympy.exp else v, args, budget)
        except (ZeroDivisionError, ValueError):
            raise _Undefined() from None
    raise _ParseError(f"cannot evaluate {type(e).__name__}")


def _is_real(v) -> bool:
    return isinstance(v, Fraction) or not isinstance(v, _MP.mpc) or v.imag == 0


def _note_complex(out, args, budget: _Budget):
    """out, noting on the budget when real arguments gave a complex value (outside the real domain)."""
    if not _is_real(out) and all(_is_real(a) for a in args):
        budget.left_reals = True
    return out


def _pow(b, x):
    if isinstance(b, Fraction) and isinstance(x, Fraction):
        if x.denominator == 1:
            n = x.numerator
            if b == 0 and n < 0:
                raise _Undefined()
            bits = max(b.numerator.bit_length(), b.denominator.bit_length())
            if abs(n) <= MAX_POW_EXP and bits * abs(n) <= MAX_EXACT_BITS:
                return b ** n
        elif b > 0 and x.denominator <= 64 and abs(x.numerator) <= MAX_POW_EXP:
            # Exact rational roots (sqrt(4) = 2, 8^(2/3) = 4) keep the value exact.
            p, q = b.numerator, b.denominator
            rp, rq = _iroot(p, x.denominator), _iroot(q, x.denominator)
            if rp is not None and rq is not None:
                return _pow(Fraction(rp, rq), Fraction(x.numerator))
    if isinstance(b, Fraction) and b == 0:
        if isinstance(x, Fraction):
            if x > 0:
                return Fraction(0)
            raise _Undefined()
    bm, xm = _to_mp(_carried(b)), _to_mp(x)
    if bm == 0:
        if xm.real > 0:
            return _MP.mpf(0)
        raise _Undefined()
    # |b^x| = exp(Re(x log b) ...): refuse before computing anything astronomically large.
    try:
        logmag = abs(xm) * (abs(_MP.log(bm)) + 1)
    except (ValueError, ZeroDivisionError):
        raise _Undefined() from None
    if logmag > MAX_MAG_BITS:
        raise _Limit("power")
    if isinstance(x, Fraction) and x.denominator > 1 and abs(x - round(x)) < _TINY:
        raise _Limit("an exponent within 1e-40 of an integer")      # 7^{1 + 10^{-60}} is not 7
    v = _tiny_check(_check_mp(_MP.power(bm, xm)))
    if isinstance(b, Fraction) and isinstance(x, Fraction) and _is_real(v) and v != 0:
        near = Fraction(str(_MP.nstr(_to_mp(v).real, 45))).limit_denominator(1000)
        if near and abs(_to_mp(v).real / _to_mp(near) - 1) < _MP.mpf(10) ** -40:
            raise _Limit("a root within 1e-40 of a rational it is not")   # \\sqrt{49 + 10^{-100}} is not 7
    return v


_TINY = Fraction(1, 10 ** 40)
_TINY_MP = _MP.mpf(10) ** -40


def _carried(v):
    """v, unless it is an exact value that carries more precision than 50-digit arithmetic keeps, about to be
    mixed with an inexact one: within 1e-40 (relative) of a simpler rational it is not ('1 + 10^{-60}' beside
    \\pi), or an integer of more than 40 significant digits. Then a limit hit, never the simpler value."""
    if not isinstance(v, Fraction) or not v:
        return v
    if v.denominator == 1:
        n = abs(v.numerator)
        if n.bit_length() > 132:        # about 40 digits: count the significant ones
            digits = str(n).rstrip("0")
            if len(digits) > 40:
                raise _Limit("an integer beyond the working precision")
        return v
    near = v.limit_denominator(10 ** 6)
    if near != v and abs(v - near) <= abs(v) * _TINY:
        raise _Limit("a value within 1e-40 of a simpler one")
    return v


def _tiny_check(v):
    """A power or exponential below 1e-40 cannot be told from 0 beside other terms at 50 digits
    ('7 + e^{-200}' would equal 7): a limit hit, never a value."""
    if not isinstance(v, Fraction) and v != 0 and abs(v) < _MP.mpf(10) ** -40:
        raise _Limit("a value below the working precision")
    return v


def _iroot(n: int, k: int) -> int | None:
    if n.bit_length() > 4000:
        return None
    r = round(n ** (1.0 / k)) if n.bit_length() < 1000 else int(_MP.nint(_MP.root(n, k)))
    for c in (r - 1, r, r + 1):
        if c >= 0 and c ** k == n:
            return c
    return None


def _close(a, b, tol: float, abs_tol=None, scale=None) -> bool:
    """|a - b| within tol relative, plus abs_tol; or, given scale (the largest term summed or angle
    of a periodic function while evaluating), plus NOISE * scale: the rounding that cancellation can
    leave at 50 digits, so sin^2 + cos^2 - 1 is 0 but e^{-1000} is not (without scale: ABS_TOL)."""
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        if a == b:
            return True
        if abs_tol is not None:
            return abs(a - b) <= abs_tol
        if tol <= EXACT_REL_TOL:
            return False
    a, b = _to_mp(a), _to_mp(b)
    if _MP.isinf(a) or _MP.isinf(b):
        return a == b
    if abs_tol is not None:
        extra = _to_mp(Fraction(abs_tol))
    else:
        extra = ABS_TOL if scale is None else NOISE * scale
    return abs(a - b) <= tol * max(abs(a), abs(b)) + extra


def _points(names: list[str], signed: bool = False, far: bool = False) -> list[dict]:
    """N_POINTS seeded rational points (positive, non-integer): the same on every run and seed.
    signed=True flips signs (equations): the second point's every other variable, the third's all;
    far=True (solution sets) adds two far points, about 97 and -89 times the first."""
    out = []
    for t in range(N_POINTS):
        rng = random.Random(7919 * (t + 1))
        out.append({n: Fraction(rng.randint(11, 97), rng.randint(5, 41)) + Fraction(1, 7)
                    for n in names})
    if signed:
        out = [{n: -v if t == 2 or (t == 1 and k % 2 == 0) else v for k, (n, v) in enumerate(p.items())}
               if t else p for t, p in enumerate(out)]
    if far:     # Two far points of both signs: the others lie within 20 of 0, where '|x - 30| = 3' and
        # '\\min(x, 30) = 30' would pass for 'x = 27' and 'x = 30'.
        out += [{n: v * 97 + Fraction(1, 3) for n, v in out[0].items()},
                {n: -v * 89 - Fraction(1, 5) for n, v in out[0].items()}]
    return out


def _free_names(e) -> set:
    return {s.name for s in e.free_symbols}


_BOUND_VALUES = (2, 3, 5, 7, 11, 13)


def _bound_names(e) -> set:
    """Names in the bounds of a \\sum / \\prod (symbolic bounds: 'm' of \\sum_{j=1}^{m})."""
    out = set()
    for x in sympy.preorder_traversal(e):
        if isinstance(x, (_SUM, _PROD)):
            out |= _free_names(x.args[1]) | _free_names(x.args[2])
    return out


def _names_outside_sums(e, depth: int) -> set:
    if isinstance(e, (_SUM, _PROD)) or depth > MAX_DEPTH:
        return set()
    if isinstance(e, sympy.Symbol):
        return {e.name}
    return set().union(*(_names_outside_sums(a, depth + 1) for a in e.args)) if e.args else set()


def _integer_points(names: list, ints: set) -> list[dict]:
    """len(_BOUND_VALUES) points: the bound names at small integers, the others as in _points."""
    out = []
    for t, k in enumerate(_BOUND_VALUES):
        rng = random.Random(7919 * (t + 1))
        out.append({n: Fraction(k) if n in ints else Fraction(rng.randint(11, 97), rng.randint(5, 41)) +
                    Fraction(1, 7) for n in names})
    return out


# ------------------------------------------------------------------------------------------------
# Evaluation of the functions sympy would simplify on creation: gcd, lcm, max, min, sums and products
# with integer bounds, and m! / \binom{m}{k} at a symbol's (non-integer) sample points via Gamma.

def _gamma_of(fn, *args):
    """fn (Gamma or binomial) at real values that are not all integers: m! and \\binom{m}{2} for a
    symbol m, evaluated at its sample points like any other function."""
    if any(not isinstance(a, Fraction) and abs(a.imag) > ABS_TOL for a in args) or \
            any(abs(_to_mp(a)) > MAX_GAMMA_ARG for a in args):
        raise _Limit("factorial")
    try:
        return _check_mp(_MP.mpf(fn(_MP.mpf(_to_mp(args[0]).real))))
    except (ZeroDivisionError, ValueError):
        raise _Undefined() from None


def _ev_big_operator(e, env: dict, budget: _Budget):
    lam, lo, hi = e.args
    lo, hi = _ev(lo, env, budget), _ev(hi, env, budget)
    if not all(isinstance(x, Fraction) and x.denominator == 1 for x in (lo, hi)):
        raise _Undefined()
    if hi - lo + 1 > MAX_SUM_TERMS:
        raise _Limit("sum length")
    name = lam.variables[0].name
    acc = Fraction(0) if type(e) is _SUM else Fraction(1)
    for k in range(int(lo), int(hi) + 1):
        v = _ev(lam.expr, {**env, name: Fraction(k)}, budget)
        if isinstance(acc, Fraction) and isinstance(v, Fraction):
            acc = acc + v if type(e) is _SUM else acc * v
            if not _exact_ok(acc):
                acc = _to_mp(acc)
        else:
            acc = _check_mp(_to_mp(acc) + _to_mp(v) if type(e) is _SUM else _to_mp(acc) * _to_mp(v))
    return acc


def _ev_gcd(vals, lcm=False):
    if not all(isinstance(v, Fraction) and v.denominator == 1 for v in vals):
        raise _Undefined()
    ints = [abs(int(v)) for v in vals]
    if any(i.bit_length() > 4096 for i in ints):
        raise _Limit("gcd size")
    return Fraction(math.lcm(*ints) if lcm else math.gcd(*ints))


def _ev_extreme(vals, pick):
    reals = [v if isinstance(v, Fraction) else _as_real(v) for v in vals]
    if any(r is None for r in reals):
        raise _Undefined()
    return pick(reals, key=lambda r: _to_mp(r))


_NARY_EVAL = {
    _NARY["gcd"]: _ev_gcd, _NARY["lcm"]: lambda vals: _ev_gcd(vals, lcm=True),
    _NARY["max"]: lambda vals: _ev_extreme(vals, max), _NARY["min"]: lambda vals: _ev_extreme(vals, min),
}


# ------------------------------------------------------------------------------------------------
# Comparison of structures.

def _val_equal(a: Val, b: Val, tol: float, budget: _Budget, signed: bool = False) -> bool:
    # The percent dual reading (departure 4) only when exactly one side has a percent: 0.12% is not 12%.
    cands_a = [(a, Fraction(1))] + ([(a, Fraction(1, 100))] if a.percent and not b.percent else [])
    cands_b = [(b, Fraction(1))] + ([(b, Fraction(1, 100))] if b.percent and not a.percent else [])
    use_tol = tol if (a.inexact or b.inexact) else EXACT_REL_TOL
    names = sorted((_free_names(a.expr) | _free_names(b.expr)) - {"__pm__"})
    # '\\sum_{j=1}^{m} j' against 'm(m+1)/2': integer points for m. a is the prediction: its bounds
    # count only for names it uses nowhere else ('\\sum_{j=1}^{x} 0 + \\lfloor x \\rfloor' is not x).
    bounds = (_bound_names(a.expr) - _names_outside_sums(a.expr, 0) | _bound_names(b.expr)) & set(names)
    if bounds:
        points, signed = _integer_points(names, bounds), True
    else:
        points = _points(names, signed, far=signed) if names else [{}]
    for va, sa in cands_a:
        for vb, sb in cands_b:
            if _agree(va, sa, vb, sb, points, use_tol, budget) and (
                    signed or not names or _agree_signed(va, sa, vb, sb, names, use_tol, budget)) and (
                    bounds or not names or _agree_signed(va, sa, vb, sb, names, use_tol, budget, _wide_points(names))):
                return True
    return False


def _wide_points(names: list) -> list[dict]:
    """Points of both signs, small and large (about 0.003 and 4,000 to 80,000), where piecewise forms part
    from the gold: '\\min(x, 1000)', '\\max(x, -1000)' agree with x at every point below 20 (departure 2)."""
    first, F = _points(names)[0], Fraction
    return [{}] + [{n: v * f + c for n, v in first.items()} for f, c in (
        (F(1, 1000), F(1, 997)), (F(-1, 1000), F(-1, 991)), (F(4001), F(1, 3)), (F(-3989), F(-1, 5)))]


def _agree_signed(a: Val, sa, b: Val, sb, names, tol, budget, points=None) -> bool:
    """Agreement at points of both signs wherever both sides stay real (departure 2): |u| is not u,
    but \\ln(u^2) and 2\\ln u (complex for u < 0) are not told apart by a negative u. A point where either
    side is undefined or beyond the caps (e^x at x = 80,000) is skipped."""
    for p in (points or _points(names, signed=True))[1:]:
        budget.left_reals, budget.scale = False, 0
        try:
            x = _ev(a.expr, {**p, **a.env}, budget)
            y = _ev(b.expr, {**p, **b.env}, budget)
        except (_Undefined, _Limit):
            continue
        if budget.left_reals:
            continue
        x = x * sa if isinstance(x, Fraction) else x * _MP.mpf(sa.numerator) / sa.denominator
        y = y * sb if isinstance(y, Fraction) else y * _MP.mpf(sb.numerator) / sb.denominator
        if not _close(x, y, tol, scale=budget.scale):
            return False
    budget.left_reals = False
    return True


def _agree(a: Val, sa, b: Val, sb, points, tol, budget) -> bool:
    valid = 0
    for k, p in enumerate(points):
        budget.scale = 0
        try:
            x = _ev(a.expr, {**p, **a.env}, budget)
            y = _ev(b.expr, {**p, **b.env}, budget)
        except _Undefined:
            if len(points) == 1:
                return False
            continue
        except _Limit:
            if k < N_POINTS:
                raise
            continue        # a far point (solution sets) beyond the caps: e^{at} at a, t near 1900
        if sa != 1:
            x = x * sa if isinstance(x, Fraction) else x * _MP.mpf(sa.numerator) / sa.denominator
        if sb != 1:
            y = y * sb if isinstance(y, Fraction) else y * _MP.mpf(sb.numerator) / sb.denominator
        if not _close(x, y, tol, scale=budget.scale):
            return False
        # A lone decimal against an exact value must also be that value correctly rounded to the
        # decimal's own digits: 100.01 is not 100 and 1.000001 is not 1, though within rel_tol.
        # A looser rel_tol (Minerva) says the golds are rounded themselves, so only rel_tol counts.
        if tol <= APPROX_GOLD_TOL and b.half_ulp is not None and isinstance(x, Fraction) and x != y:
            return False    # an exact decimal gold (0.5) is met exactly by a rational answer: 0.50004 is not it
        for v, s, other in ((a, sa, b), (b, sb, a)):
            if tol <= APPROX_GOLD_TOL and v.half_ulp is not None and not other.inexact and not _close(
                    x, y, 0.0, abs_tol=v.half_ulp * s * (1 + Fraction(1, 10 ** 9))):
                return False
            # An explicit decimal term is part of the number: '12 + 0.00001' and '\\pi + 0.00001' differ from
            # 12 and \\pi by half their smallest decimal or more, so they are other numbers, not within rel_tol.
            if tol <= APPROX_GOLD_TOL and v.least_decimal is not None and not other.inexact and \
                    abs(_to_mp(x) - _to_mp(y)) >= _to_mp(v.least_decimal * abs(s)) / 2:
                return False
        valid += 1
    return valid >= min(2, len(points))


def _eqn_diff(e: Eqn) -> Val:
    d = sympy.Add(e.lhs.expr, _neg(e.rhs.expr), evaluate=False)
    return Val(d, e.lhs.inexact or e.rhs.inexact, False, {**e.lhs.env, **e.rhs.env})


def _eqn_equal(a: Eqn, b: Eqn, tol: float, budget: _Budget) -> bool:
    if a.op != b.op:
        flip = {"<": ">", ">": "<", "<=": ">=", ">=": "<="}
        if flip.get(a.op) != b.op:
            return False
        b = Eqn(b.rhs, b.lhs, a.op)
    # Equations are solution sets: points of both signs, so 'y = \\sqrt{x^2}' is not 'y = x'.
    if _val_equal(a.lhs, b.lhs, tol, budget, signed=True) and \
            _val_equal(a.rhs, b.rhs, tol, budget, signed=True):
        return True
    # Same relation up to a constant factor: (l1 - r1) / (l2 - r2) is constant, and positive for an
    # inequality ('4y < 8a' is 'y - 2a < 0', not '2a - y < 0').
    da, db = _eqn_diff(a), _eqn_diff(b)
    names = sorted((_free_names(da.expr) | _free_names(db.expr)) - {"__pm__"})
    if not names:
        return False
    ratios = []
    for p in _points(names, signed=True, far=True):
        budget.left_reals = False
        try:
            x = _ev(da.expr, {**p, **da.env}, budget)
            y = _ev(db.expr, {**p, **db.env}, budget)
        except (_Undefined, _Limit):
            continue        # (a far point may go beyond the caps)
        if budget.left_reals:
            budget.left_reals = False
            continue
        if _close(y, Fraction(0), EXACT_REL_TOL) or _close(x, Fraction(0), EXACT_REL_TOL):
            return False
        ratios.append(x / y if isinstance(x, Fraction) and isinstance(y, Fraction)
                      else _to_mp(x) / _to_mp(y))
    use_tol = tol if (da.inexact or db.inexact) else 1e-30     # ratios of differences: cancellation
    if a.op not in ("=", "!="):
        r0 = _as_real(ratios[0]) if ratios else None
        if r0 is None or r0 <= 0:
            return False
    if len(ratios) >= 2 and all(_close(r, ratios[0], use_tol) for r in ratios[1:]):
        return True
    if a.op != "=" or len(names) < 2 or _free_names(da.expr) != _free_names(db.expr):
        return False
    return _same_real_roots(da, db, names, budget)


# Equations in several variables with the same solution set though not proportional
# ('x^3 = y^3' and 'x = y'): for sampled values of the other variables, both are polynomials of low
# degree in the last variable with the same real roots.


def _same_real_roots(da: Val, db: Val, names: list, budget: _Budget) -> bool:
    v = names[-1]
    nonempty = False
    for p in _points(names[:-1], signed=True):
        roots = [_real_roots(d, v, p, budget) for d in (da, db)]
        if roots[0] is None or roots[1] is None or len(roots[0]) != len(roots[1]):
            return False
        if not all(abs(x - y) <= 1e-10 * (1 + abs(x)) for x, y in zip(*roots)):
            return False
        nonempty = nonempty or bool(roots[0])
    return nonempty


def _real_roots(d: Val, v: str, point: dict, budget: _Budget):
    """The distinct real roots in v of the expression d (other variables fixed at point), when d is a
    polynomial in v of degree 1..MAX_ROOT_DEGREE; else None. The polynomial is found by exact
    interpolation at MAX_ROOT_DEGREE + 1 nodes and checked at two more."""
    for k, e in enumerate(sympy.preorder_traversal(d.expr)):
        if k > MAX_NODES or isinstance(e, sympy.Pow) and isinstance(e.exp, sympy.Integer) and \
                abs(e.exp) > 4 * MAX_ROOT_DEGREE:
            return None             # a high power: not a low-degree polynomial worth solving
    nodes = [Fraction(2 * k - 7, 3) for k in range(MAX_ROOT_DEGREE + 3)]
    ys = []
    for t in nodes:
        try:
            y = _ev(d.expr, {**point, **d.env, v: t}, budget)
        except _Undefined:
            return None
        if not isinstance(y, Fraction) or y.numerator.bit_length() + y.denominator.bit_length() > 4096:
            return None             # only low-degree polynomials with rational coefficients: exact work
        ys.append(y)
    n = MAX_ROOT_DEGREE + 1
    dd = list(ys[:n])               # Newton's divided differences, exact
    for j in range(1, n):
        for k in range(n - 1, j - 1, -1):
            dd[k] = (dd[k] - dd[k - 1]) / (nodes[k] - nodes[k - j])
    coef = [Fraction(0)] * n        # coef[j] of v**j, from the Newton form by Horner's rule
    for k in range(n - 1, -1, -1):
        coef = [(coef[j - 1] if j else 0) - nodes[k] * coef[j] for j in range(n)]
        coef[0] += dd[k]
    budget.tick(n * n)
    for t, y in zip(nodes[n:], ys[n:]):
        if sum(c * t ** j for j, c in enumerate(coef)) != y:
            return None             # not a polynomial of low degree in v
    while coef and coef[-1] == 0:
        coef.pop()
    if len(coef) < 2:
        return None                 # constant in v: no roots or every value
    if len(coef) == 2:              # linear and quadratic: exact discriminant, closed form
        return [_to_mp(-coef[0] / coef[1])]
    if len(coef) == 3:
        c0, c1, c2 = coef
        disc = c1 * c1 - 4 * c2 * c0
        if disc < 0:
            return []
        r = _MP.sqrt(_to_mp(disc))
        return sorted({(-_to_mp(c1) - r) / _to_mp(2 * c2), (-_to_mp(c1) + r) / _to_mp(2 * c2)})
    try:
        found = _MP_ROOTS.polyroots([_MP_ROOTS.mpf(c.numerator) / c.denominator for c in reversed(coef)],
                                    maxsteps=50, extraprec=20)
    except Exception:               # mpmath raises NoConvergence (a plain Exception subclass)
        return None
    real = sorted(_MP.mpf(r.real) if isinstance(r, _MP_ROOTS.mpc) else _MP.mpf(r) for r in
                  (found if isinstance(found, list) else [found])
                  if not isinstance(r, _MP_ROOTS.mpc) or abs(r.imag) <= 1e-12 * (1 + abs(r)))
    out = []
    for r in real:
        if not out or not (abs(r - out[-1]) <= 1e-9 * (1 + abs(r))):
            out.append(r)           # a double root is one point of the solution set
    return out


def _has_free_pm(node) -> bool:
    return isinstance(node, Val) and "__pm__" not in node.env and _PM in node.expr.free_symbols


def _expand_pm(items: list) -> list:
    """Items whose value uses \\pm become two items (sign +1 and -1): departure 8."""
    out = []
    for it in items:
        if _has_free_pm(it):
            out.append(Val(it.expr, it.inexact, it.percent, {**it.env, "__pm__": Fraction(1)}))
            out.append(Val(it.expr, it.inexact, it.percent, {**it.env, "__pm__": Fraction(-1)}))
        elif isinstance(it, Eqn) and it.op == "=" and _has_free_pm(it.rhs):     # x = 1 \pm \sqrt2
            out.extend(Eqn(it.lhs, r) for r in _expand_pm([it.rhs]))
        else:
            out.append(it)
    return out


def _unordered_equal(xs: list, ys: list, tol, budget) -> bool:
    if len(xs) != len(ys):
        return False
    used = [False] * len(ys)
    for x in xs:
        for j, y in enumerate(ys):
            if not used[j] and _equal(x, y, tol, budget):
                used[j] = True
                break
        else:
            return False
    return True


def _distinct(xs: list, tol, budget) -> list:
    """The items of a set without repeats: \\{3, 5, 3\\} is \\{3, 5\\}."""
    out = []
    for x in xs:
        if not any(_equal(x, y, tol, budget) for y in out):
            out.append(x)
    return out


def _ordered_equal(xs: list, ys: list, tol, budget) -> bool:
    return len(xs) == len(ys) and all(_equal(x, y, tol, budget) for x, y in zip(xs, ys))


def _as_items(node):
    """A node as a list of items when it is a list-like (bare list, or a single \\pm value)."""
    if isinstance(node, Seq) and node.open == "":
        return _expand_pm(node.items)
    if _has_free_pm(node) or isinstance(node, Eqn) and node.op == "=" and _has_free_pm(node.rhs):
        return _expand_pm([node])      # 'x = 2 \\pm \\sqrt3' is 'x = 2+\\sqrt3, x = 2-\\sqrt3'
    return None


def _vector(node):
    if isinstance(node, Matrix):
        if len(node.rows) == 1:
            return node.rows[0]
        if all(len(r) == 1 for r in node.rows):
            return [r[0] for r in node.rows]
    return None


def _unwrap_assignment(node):
    """'x = 5' -> 5 when the left side is a single symbol (departure 9)."""
    if isinstance(node, Eqn) and node.op == "=" and isinstance(node.lhs.expr, sympy.Symbol) \
            and node.lhs.expr not in node.rhs.expr.free_symbols:
        return node.rhs
    return None


# Inequalities, intervals and unions are compared as sets of real numbers (departure 18).
# A set is (variable name or None, inexact, [(lo, lo_closed, hi, hi_closed), ...]) with mpf ends.

_INEQ_OPS = frozenset(("<", "<=", ">", ">=", "!="))
_FLIP = {"<": ">", ">": "<", "<=": ">=", ">=": "<=", "!=": "!=", "=": "="}
_SOLVE_POINTS = (Fraction(0), Fraction(1), Fraction(2), Fraction(-1), Fraction(-3), Fraction(13, 7),
                 Fraction(-29, 11))


def _set_like(node) -> bool:
    if isinstance(node, Eqn):
        return node.op in _INEQ_OPS
    if isinstance(node, Chain):
        return any(op in _INEQ_OPS for op in node.ops)
    # A bare comma list of inequalities is not read as a set: 'x < -1, x > 4' means 'or' but
    # 'x \\ne 1, x \\ne 2' means 'and'. Written 'or' / 'and' they are \\cup / \\cap (see _clean).
    return isinstance(node, (Inter, Union, Minus))


def _real_value(v: Val, budget: _Budget):
    """The value of a constant Val as a real mpf, or None (free symbols, complex, undefined)."""
    if _free_names(v.expr) - {"__pm__"}:
        return None
    try:
        return _as_real(_ev(v.expr, dict(v.env), budget))
    except _Undefined:
        return None


def _as_real(v):
    """A Fraction or 50-digit number as a real mpf; None when it has an imaginary part."""
    v = _to_mp(v)
    if abs(v.imag) > ABS_TOL:
        return None
    return _MP.mpf(v.real)


def _near(x, y) -> bool:
    if _MP.isinf(x) or _MP.isinf(y):
        return x == y
    return abs(x - y) <= 1e-30 * max(1, abs(x), abs(y))


def _normalise(ivs: list) -> list:
    """Sorted, merged, non-empty intervals."""
    ivs = sorted((iv for iv in ivs if iv[0] < iv[2] or (_near(iv[0], iv[2]) and iv[1] and iv[3])),
                 key=lambda iv: (iv[0], not iv[1]))
    out = []
    for lo, lc, hi, hc in ivs:
        if out:
            plo, plc, phi, phc = out[-1]
            if lo < phi and not _near(lo, phi) or (_near(lo, phi) and (phc or lc)):
                if hi > phi and not _near(hi, phi):
                    out[-1] = (plo, plc, hi, hc)
                elif _near(hi, phi):
                    out[-1] = (plo, plc, phi, phc or hc)
                continue
        out.append((lo, lc, hi, hc))
    return out


def _intersect(xs: list, ys: list) -> list:
    out = []
    for alo, alc, ahi, ahc in xs:
        for blo, blc, bhi, bhc in ys:
            lo, lc = (alo, alc and blc) if _near(alo, blo) else max((alo, alc), (blo, blc), key=lambda t: t[0])
            hi, hc = (ahi, ahc and bhc) if _near(ahi, bhi) else min((ahi, ahc), (bhi, bhc), key=lambda t: t[0])
            out.append((lo, lc, hi, hc))
    return _normalise(out)


def _complement(ivs: list) -> list:
    """The real line without the sorted, merged intervals ivs."""
    out, lo, lc = [], -_MP.inf, False
    for a, ac, b, bc in ivs:
        out.append((lo, lc, a, not ac))
        lo, lc = b, not bc
    out.append((lo, lc, _MP.inf, False))
    return _normalise([iv for iv in out if not (_MP.isinf(iv[0]) and _MP.isinf(iv[2]) and iv[0] == iv[2])])


def _ray(op: str, r) -> list:
    """The real numbers v with 'v op r' as intervals; '=' is the single point r."""
    inf = _MP.inf
    return {"<": [(-inf, False, r, False)], "<=": [(-inf, False, r, True)],
            ">": [(r, False, inf, False)], ">=": [(r, True, inf, False)], "=": [(r, True, r, True)],
            "!=": [(-inf, False, r, False), (r, False, inf, False)]}[op]


def _solve(lhs: Val, rhs: Val, op: str, budget: _Budget):
    """lhs op rhs in one variable, linear in it or in its absolute value -> (name, intervals)."""
    names = sorted((_free_names(lhs.expr) | _free_names(rhs.expr)) - {"__pm__"})
    if len(names) > 1:
        # '0 < g(x) < 2': a product of symbols against a constant bounds that product.
        for side, other, o in ((lhs, rhs, op), (rhs, lhs, _FLIP[op])):
            if isinstance(side.expr, sympy.Mul) and all(x.is_Symbol for x in side.expr.args) and \
                    not _free_names(other.expr) - {"__pm__"}:
                r = _real_value(other, budget)
                return None if r is None else ("*".join(names), _normalise(_ray(o, r)))
    if len(names) != 1:
        return None
    f = sympy.Add(lhs.expr, _neg(rhs.expr), evaluate=False)
    env0 = {**lhs.env, **rhs.env}
    try:
        vals = [_as_real(_ev(f, {**env0, names[0]: t}, budget)) for t in _SOLVE_POINTS]
    except _Undefined:
        return None
    if any(v is None for v in vals):
        return None
    for g in (lambda t: t, abs):
        a, b = vals[1] - vals[0], vals[0]
        if abs(a) <= 1e-30 * (1 + abs(b)):
            return None
        if all(_near(v, a * _to_mp(g(t)) + b) or abs(v - (a * _to_mp(g(t)) + b)) <= 1e-35
               for t, v in zip(_SOLVE_POINTS, vals)):
            r = -b / a
            sol = _ray(op if a > 0 else _FLIP[op], r)
            inf = _MP.inf
            if g is abs:    # |v| op r: the part with |v| >= 0, mirrored to negative v
                sol = _intersect(sol, [(_MP.mpf(0), True, inf, False)])
                sol = sol + [(-hi, hc, -lo, lc) for lo, lc, hi, hc in sol]
            return names[0], _normalise(sol)
    return None


def _real_set(node, budget: _Budget):
    """(variable or None, inexact, intervals) of a set-like answer, or None."""
    budget.tick()
    if isinstance(node, Seq) and node.open in ("(", "[") and len(node.items) == 2 and \
            all(isinstance(x, Val) for x in node.items):
        lo, hi = (_real_value(x, budget) for x in node.items)
        if lo is None or hi is None or not lo < hi:
            return None
        inexact = any(x.inexact for x in node.items)
        return None, inexact, [(lo, node.open == "[" and not _MP.isinf(lo), hi,
                                node.close == "]" and not _MP.isinf(hi))]
    if isinstance(node, Seq) and node.open == "{" and all(isinstance(x, Val) for x in node.items):
        points = [_real_value(x, budget) for x in node.items]       # a finite set: its points
        if any(p is None for p in points):
            return None
        return None, any(x.inexact for x in node.items), _normalise([(p, True, p, True) for p in points])
    if isinstance(node, Eqn) and (node.op in _INEQ_OPS or node.op == "="):   # 't = 2' is the point 2
        got = _solve(node.lhs, node.rhs, node.op, budget)
        return None if got is None else (got[0], node.lhs.inexact or node.rhs.inexact, got[1])
    if isinstance(node, Chain) and all(op in _INEQ_OPS or op == "=" for op in node.ops):
        members = [Eqn(node.parts[k], node.parts[k + 1], op) for k, op in enumerate(node.ops)]
        return _combine([_real_set(m, budget) for m in members], _intersect)
    if isinstance(node, Inter):
        return _combine([_real_set(m, budget) for m in node.items], _intersect)
    if isinstance(node, Minus):     # '\\mathbb{R} \\setminus \\{2\\}', '[0,3] \\setminus (1,2)'
        got = _combine([_real_set(node.whole, budget), _real_set(node.removed, budget)], lambda x, y: x)
        removed = _real_set(node.removed, budget) if got is not None else None
        return None if removed is None else (got[0], got[1], _intersect(got[2], _complement(removed[2])))
    if isinstance(node, Union):
        return _combine([_real_set(m, budget) for m in node.items], lambda x, y: _normalise(x + y))
    return None


def _combine(sets: list, op):
    if not sets or any(s is None for s in sets):
        return None
    names = {s[0] for s in sets} - {None}
    if len(names) > 1:
        return None
    out = sets[0][2]
    for s in sets[1:]:
        out = op(out, s[2])
    return (names.pop() if names else None), any(s[1] for s in sets), out


def _sets_equal(x, y, tol: float) -> bool:
    if x[0] is not None and y[0] is not None and x[0] != y[0]:
        return False
    use_tol = tol if (x[1] or y[1]) else EXACT_REL_TOL
    if len(x[2]) != len(y[2]):
        return False
    for (alo, alc, ahi, ahc), (blo, blc, bhi, bhc) in zip(x[2], y[2]):
        for p, q in ((alo, blo), (ahi, bhi)):
            if not (_near(p, q) or _close(p, q, use_tol)):
                return False
        if (alc != blc and not _MP.isinf(alo)) or (ahc != bhc and not _MP.isinf(ahi)):
            return False
    return True


# Readings of the prediction (departure 17): a named answer is its value, a chain its last value.

def _readings(node, gold, tol: float, budget: _Budget) -> list:
    """The prediction and the other ways to read it: 'x+y = 9' -> 9, 't = 2+3+4 = 9' -> 9,
    '\\frac17 \\approx 0.14' -> 1/7 (and 0.14 when the gold is a decimal or the exact part is a name)."""
    if isinstance(node, Eqn) and node.op == "=" and isinstance(node.rhs.expr, sympy.Symbol) and \
            not _free_names(node.lhs.expr) and node.rhs.expr != _PM:
        node = Eqn(node.rhs, node.lhs, "=")        # '7 = x' states x = 7
    out = [node]
    if isinstance(gold, (Eqn, Chain)) or (isinstance(gold, Seq) and any(
            isinstance(x, (Eqn, Chain)) for x in gold.items)):
        # The gold names its answer too: names must match (x = 5 is not y = 5). 'x = 5+5+1 = 11'
        # against a gold 'x = 11' names x: its stated value is compared.
        pa = _as_assignment(node, budget)
        if pa is not None and pa is not node:
            out.append(pa)
        return out
    alt = _chain_value(node, gold, tol, budget)
    if alt:
        out.extend(alt)
    grouped = _named_values(node, tuples_only=True)
    if grouped is not None:
        out.append(grouped)       # 'a=3, b=1; a=5, b=1' -> (3,1), (5,1)
    if isinstance(node, Seq) and node.open == "" and any(isinstance(x, (Eqn, Chain)) for x in node.items):
        items = []
        for x in node.items:
            v = _chain_value(x, gold, tol, budget) if _unwrap_assignment(x) is None else None
            items.append(v[0] if v else x)     # 'y = 1, x = 2' keeps its names (ordered by them)
        out.append(Seq(items))
    return out


def _named_values(node, tuples_only: bool = False):
    """The values of named answers: 'PQ = 6, RS = 2' -> 6, 2 and 'a=3, b=1; a=5, b=1' (names
    repeating in a cycle) -> (3,1), (5,1). None when node is not such a list."""
    items = node.items if isinstance(node, Seq) and node.open == "" else [node]
    if not items or not all(isinstance(x, Eqn) and x.op == "=" and _is_label(x.lhs.expr) and
                            not _free_names(x.rhs.expr) - {"__pm__"} for x in items):
        return None
    names = [str(x.lhs.expr) for x in items]
    p = len(set(names))
    if 2 <= p < len(items) and len(items) % p == 0 and names == names[:p] * (len(items) // p):
        return Seq([Seq([x.rhs for x in items[k:k + p]], "(", ")") for k in range(0, len(items), p)])
    if tuples_only or len(set(names)) != len(names):
        return None
    return items[0].rhs if len(items) == 1 else Seq([x.rhs for x in items])


def _is_label(e) -> bool:
    """A label of a value: x, x_1, PQ, |PQ|, V_1 : V_2. No sums ('y' + ry = 0' is an equation) and
    no products of lower-case letters ('xy = 0' is an equation too)."""
    if isinstance(e, sympy.Abs):
        e = e.args[0]
    if isinstance(e, sympy.Symbol):
        return e != _PM
    if isinstance(e, sympy.Mul) and len(e.args) <= 4 and all(n[:1].isupper() for n in _free_names(e)):
        return all(a is S.One or isinstance(a, (sympy.Symbol, sympy.Mul)) and _is_label(a) or (
            isinstance(a, sympy.Pow) and a.exp is S.NegativeOne and isinstance(a.base, sympy.Symbol))
            for a in e.args)
    return False


def _has_relation(node) -> bool:
    if isinstance(node, (Eqn, Chain, Inter, Union, Minus)):
        return True
    return isinstance(node, Seq) and any(_has_relation(x) for x in node.items)


def _as_assignment(node, budget: _Budget | None = None):
    """'x = 5' and the chain 'x = 2+3 = 5' (up to its first '~') as the assignment x = 5, else None.
    With a budget (a prediction), a chain whose approximations do not hold states nothing."""
    if isinstance(node, Eqn) and node.op == "=" and isinstance(node.lhs.expr, sympy.Symbol):
        return node
    if isinstance(node, Chain) and isinstance(node.parts[0].expr, sympy.Symbol) and \
            all(op in ("=", "~") for op in node.ops) and (
                budget is None or _chain_holds(node.parts, node.ops, DEFAULT_REL_TOL, budget)):
        k = node.ops.index("~") if "~" in node.ops else len(node.ops)
        if k > 0 and all(op == "=" for op in node.ops[:k]):
            return Eqn(node.parts[0], node.parts[k])
    return None


def _chain_value(node, gold, tol: float, budget: _Budget) -> list:
    if isinstance(node, Eqn) and node.op == "=":
        parts, ops = [node.lhs, node.rhs], ["="]
    elif isinstance(node, Chain) and all(op in ("=", "~") for op in node.ops):
        parts, ops = node.parts, node.ops
    else:
        return []
    head_is_name = _is_name(parts[0].expr)
    k = ops.index("~") if "~" in ops else len(ops)
    const = [not (_free_names(p.expr) - {"__pm__"}) for p in parts]
    out = []
    # The stated value before the first '~': the last '=' part, when it is a constant and every
    # part before it is a name or a constant ('2x + 1 = 7' is an equation to solve, not 7).
    # In a longer chain ('\\pi r^2 = 4\\pi \\approx 12.57') the head is what is being computed.
    head_ok = head_is_name or len(parts) >= 3
    if not _chain_holds(parts, ops, tol, budget):
        return []       # '4 = 5', '0 = 1 = 2', '5 \\approx 5.1': a false chain states no value
    if const[k] and all(const[j] or (j == 0 and head_ok) for j in range(k)):
        out.append(parts[k])
    if "~" in ops and const[-1] and k == 0 and head_is_name:
        out.append(parts[-1])       # 't \\approx 9'; '\\frac17 \\approx 0.14' is 1/7 whatever the gold
    return out


def _chain_holds(parts: list, ops: list, tol: float, budget: _Budget) -> bool:
    """The constants of a chain before its first '\\approx' are equal, and every '\\approx' approximates
    what it follows: a name ('t \\approx 9'), or a constant within half a unit in the approximation's
    last place (a decimal or integer literal), else within 1%; and all of them approximate one value (the
    exact one when it is written), so no value is rounded twice."""
    k = ops.index("~") if "~" in ops else len(ops)
    consts = [p for p in parts[:k + 1] if not (_free_names(p.expr) - {"__pm__"})]
    if any(not _val_equal(p, consts[-1], tol, budget) for p in consts[:-1]):
        return False
    if not all(op != "~" or (j == 0 and _is_name(parts[0].expr)) or _approx_true(parts[j], parts[j + 1], budget)
               for j, op in enumerate(ops)):
        return False
    # Not rounded twice: the values each approximation allows (half a unit in its last place around
    # it) must overlap, and hold the exact value when one is written: 'y \\approx 11.46 \\approx 11.5 \\approx 12'
    # states nothing (11.46 is no rounding of anything that rounds to 12).
    spans = [_approx_span(parts[j + 1], budget) for j, op in enumerate(ops) if op == "~"]
    if k < len(parts) and consts and parts[k] is consts[-1]:
        try:
            x = _to_mp(_ev(parts[k].expr, dict(parts[k].env), budget))
        except _Undefined:
            return False
        if not _is_real(x):
            return False
        x = _MP.mpf(x.real)
        spans.append((x, x))
    return len(spans) < 2 or max(a for a, _ in spans) <= min(b for _, b in spans) + ABS_TOL


def _approx_span(approx: Val, budget: _Budget) -> tuple:
    """(lo, hi): the values an approximation stands for, as _approx_true allows them."""
    try:
        y = _to_mp(_ev(approx.expr, dict(approx.env), budget))
    except _Undefined:
        return (_MP.inf, -_MP.inf)
    if not _is_real(y):
        return (_MP.inf, -_MP.inf)
    y = _MP.mpf(y.real)
    if approx.half_ulp is not None:
        room = _to_mp(approx.half_ulp)
    elif isinstance(approx.expr, sympy.Integer):
        room = _MP.mpf(0.5)
    else:
        room = abs(y) / 100
    room = room * (1 + _MP.mpf(10) ** -9)
    return (y - room, y + room)


def _approx_true(exact: Val, approx: Val, budget: _Budget) -> bool:
    try:
        x, y = _to_mp(_ev(exact.expr, dict(exact.env), budget)), _to_mp(_ev(approx.expr, dict(approx.env), budget))
    except _Undefined:
        return False            # a name, a free \\pm or an undefined value: not a stated approximation
    if approx.half_ulp is not None:
        room = _to_mp(approx.half_ulp)
    elif isinstance(approx.expr, sympy.Integer):
        room = _MP.mpf(0.5)
    else:
        room = abs(y) / 100
    return abs(x - y) <= room * (1 + _MP.mpf(10) ** -9) + ABS_TOL


def _has_decimal(node) -> bool:
    if isinstance(node, Val):
        return node.inexact
    if isinstance(node, Seq):
        return any(_has_decimal(x) for x in node.items)
    return False


def _finite_union(node, tol: float, budget: _Budget):
    """'\\{1,2\\} \\cup \\{2,3\\}' -> '\\{1,2,3\\}': a union of finite sets is one set."""
    if not (isinstance(node, Union) and all(isinstance(x, Seq) and x.open == "{" for x in node.items)):
        return node
    out = []
    for x in _expand_pm([y for s in node.items for y in s.items]):
        if not any(_equal(x, y, tol, budget) for y in out):
            out.append(x)
    return Seq(out, "{", "}")


def _list_matrix(node):
    """'[[1, 2], [3, 4]]' (a list of rows, as Python writes it) -> the matrix with those rows."""
    if isinstance(node, Seq) and node.open == "[" and node.close == "]" and node.items and all(
            isinstance(r, Seq) and r.open == "[" and r.close == "]" and all(isinstance(v, Val) for v in r.items)
            and len(r.items) == len(node.items[0].items) for r in node.items):
        return Matrix([list(r.items) for r in node.items])
    return node


def _by_name(items: list) -> list:
    """Assignments 'y = 1, x = 2' in the order of their names, for comparison with a tuple."""
    if items and all(isinstance(x, Eqn) and x.op == "=" and isinstance(x.lhs.expr, sympy.Symbol)
                     for x in items):
        names = [x.lhs.expr.name for x in items]
        if len(set(names)) == len(names):
            return [x for _, x in sorted(zip(names, items), key=lambda t: t[0])]
    return items


def _equal(a, b, tol: float, budget: _Budget) -> bool:
    budget.tick()
    if isinstance(a, _Undef) or isinstance(b, _Undef):
        return False
    a, b = _finite_union(a, tol, budget), _finite_union(b, tol, budget)
    if _set_like(a) or _set_like(b):
        sa = _real_set(a, budget)
        sb = _real_set(b, budget) if sa is not None else None
        if sa is not None and sb is not None:
            return _sets_equal(sa, sb, tol)
    ia, ib = _as_items(a), _as_items(b)
    if ia is not None or ib is not None:
        if ia is not None and ib is not None:
            return _unordered_equal(ia, ib, tol, budget)
        other = b if ia is not None else a
        items = ia if ia is not None else ib
        if isinstance(other, Seq) and other.open == "(" and isinstance(a, Seq) \
                and isinstance(b, Seq):
            if all(isinstance(x, Seq) and x.open == "(" and x.close == ")" for x in items + other.items):
                return _unordered_equal(items, other.items, tol, budget)   # ((1,2),(3,4)): a list of pairs
            return _ordered_equal(_by_name(a.items), _by_name(b.items), tol, budget)  # list vs tuple
        if isinstance(other, Seq) and other.open == "{":
            return _unordered_equal(_distinct(items, tol, budget),
                                    _distinct(_expand_pm(other.items), tol, budget), tol, budget)
        if len(items) == 1:
            return _equal(items[0], other, tol, budget)
        return False
    if isinstance(a, Val) and isinstance(b, Val):
        return _val_equal(a, b, tol, budget)
    if isinstance(a, Eqn) and isinstance(b, Eqn):
        if _eqn_equal(a, b, tol, budget):
            return True
        ua, ub = _unwrap_assignment(a), _unwrap_assignment(b)
        return ua is not None and ub is not None and a.lhs.expr == b.lhs.expr and \
            _val_equal(ua, ub, tol, budget, signed=True)
    if isinstance(a, Eqn) or isinstance(b, Eqn):
        ua, ub = _unwrap_assignment(a), _unwrap_assignment(b)
        if ua is not None and not isinstance(b, Eqn):
            return _equal(ua, b, tol, budget)
        if ub is not None and not isinstance(a, Eqn):
            return _equal(a, ub, tol, budget)
        return False
    if isinstance(a, Chain) and isinstance(b, Chain):
        return a.ops == b.ops and all(_val_equal(x, y, tol, budget) for x, y in zip(a.parts, b.parts))
    if isinstance(a, Seq) and isinstance(b, Seq):
        if a.open == "{" or b.open == "{":      # a set: order and repeats do not count
            return a.open == b.open and _unordered_equal(
                _distinct(_expand_pm(a.items), tol, budget), _distinct(_expand_pm(b.items), tol, budget), tol, budget)
        return a.open == b.open and a.close == b.close and \
            _ordered_equal(a.items, b.items, tol, budget)
    if isinstance(a, Union) and isinstance(b, Union):
        return _unordered_equal(a.items, b.items, tol, budget)
    a, b = (_list_matrix(a) if isinstance(b, Matrix) else a), (_list_matrix(b) if isinstance(a, Matrix) else b)
    if isinstance(a, Matrix) and isinstance(b, Matrix):
        return len(a.rows) == len(b.rows) and all(
            _ordered_equal(ra, rb, tol, budget) for ra, rb in zip(a.rows, b.rows))
    va, vb = _vector(a), _vector(b)
    if va is not None and isinstance(b, Seq) and b.open == "(":
        return _ordered_equal(va, b.items, tol, budget)
    if vb is not None and isinstance(a, Seq) and a.open == "(":
        return _ordered_equal(a.items, vb, tol, budget)
    if isinstance(a, Choice) and isinstance(b, Choice):
        return a.letter == b.letter
    if isinstance(a, Text) and isinstance(b, Text):
        return a.text == b.text
    for x, y in ((a, b), (b, a)):       # a word parsed as one symbol vs the same word as text
        if isinstance(x, Text) and isinstance(y, Val) and isinstance(y.expr, sympy.Symbol):
            return x.text == y.expr.name.lower()
        if isinstance(x, Choice) and isinstance(y, Val) and isinstance(y.expr, sympy.Symbol):
            return x.letter == y.expr.name
    return False


# ------------------------------------------------------------------------------------------------
# Comparison of two answer strings (is_equivalent's work): unwrap, units, clean, parse, compare.

def _compare(pred: str, gold: str, rel_tol: float) -> bool:
    budget = _Budget()
    if len(pred) > MAX_RESPONSE_CHARS or len(gold) > MAX_RESPONSE_CHARS:
        raise _Limit("input length")
    pred, gold = _unwrap_answer(pred), _unwrap_answer(gold, gold=True)    # a worked solution -> its box
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        raise _Limit("answer length")
    up, ug = _unit_of(pred), _unit_of(gold)
    if up is not None and ug is not None and (up[0] != ug[0] or abs(up[1] / ug[1] - 1) > 1e-9):
        return False        # '5 km' against '5 m': a unit is dropped only against none or the same one
    if not _same_marks(pred, gold, up, ug):
        return False
    cp, cg = _clean(pred), _clean(gold)
    if not cp or not cg:
        return False
    try:
        pa = _parse(cp, budget, as_gold=False)
        ga = _parse(cg, budget, as_gold=True)
    except _ParseError:
        _count("parse_failures")
        pa = ga = None
        tail = _right_of_last_equals(cp)
        if tail is not None and _UNPARSED_OPERATOR_RE.search(cp[:len(cp) - len(tail)]):
            # '\\lim_{x \\to 0} \\frac{\\sin x}{x} = 1': the stated value 1 (not '7, = 15'); every side after
            # the unparsed one must be the same constant ('\\int_0^1 2x\\,dx = 1 = 12' states nothing)
            try:
                sides = [_parse(t, budget, as_gold=False) for t in _sides_after_unparsed(cp)]
                pa, ga = sides[-1], _parse(cg, budget, as_gold=True)
                if not all(isinstance(v, Val) and not _free_names(v.expr) for v in sides) or \
                        any(not _val_equal(v, pa, rel_tol, budget) for v in sides[:-1]):
                    pa = ga = None
            except _ParseError:
                pa = ga = None
            if not isinstance(pa, Val):
                pa = ga = None
    if pa is not None:
        if isinstance(ga, Chain):
            ga = _as_assignment(ga) or ga       # a gold chain 'z = 1 + 1 = 2' states z = 2
        if any(_equal(r, ga, rel_tol, budget) for r in _readings(pa, ga, rel_tol, budget)):
            return True
        gv = _named_values(ga) if not _has_relation(pa) else None
        if gv is not None and _equal(pa, gv, rel_tol, budget):
            return True             # a labelled gold 'PQ = 6, RS = 2' against the values '6, 2'
        if isinstance(pa, _Undef) or isinstance(ga, _Undef):
            return False
        if _decimal_comma_equal(cp, cg, rel_tol, budget):
            return True
        sp, sg = _word_products(cp, ga), _word_products(cg, pa)
        if sp or sg:                # 'abc' against '\\frac{ab}{2}c': the word is a product (departure 10)
            try:
                qa = _parse(cp, budget, as_gold=False, split=sp)
                qg = _parse(cg, budget, as_gold=True, split=sg)
            except _ParseError:
                qa = qg = None
            if qa is not None and any(_equal(r, qg, rel_tol, budget) for r in _readings(qa, qg, rel_tol, budget)):
                return True
    elif _norm_text(cp) == _norm_text(cg) and not _has_undefined(cp):
        return True     # neither parses: identical normalised text
    elif _named_text_equal(cp, cg) or _named_text_equal(cg, cp):
        return True     # 'V_1 : V_2 = 3 : 11' against the text '3:11': a named ratio of two
    # Last try (departure 12): a plain unit word after a number, on either side.
    up, ug = _strip_plain_unit(cp), _strip_plain_unit(cg)
    if up is None and ug is None:
        return False
    up, ug = _no_thousands(up or cp), _no_thousands(ug or cg)
    try:
        pa = _parse(up, budget, as_gold=False)
        ga = _parse(ug, budget, as_gold=True)
    except _ParseError:
        return _decimal_comma_equal(up, ug, rel_tol, budget)
    return _equal(pa, ga, rel_tol, budget) or _decimal_comma_equal(up, ug, rel_tol, budget)


# Fail closed on value: unit text after a number (\\text, \\mathrm, \\si, \\unit), congruence moduli.
_KNOWN_WORDS = frozenset(("square", "cubic", "per", "sq", "units", "unit", "exactly", "or", "and", "th", "st", "nd",
                          "rd", *(w.lower() for w in _UNIT_WORDS), *_MULTIPLIERS, *_FUNCS, *_FN_WORDS))
_MODULUS_RE = re.compile(r"\\pmod\s*(\{[^{}]*\}|\w+)|\(\s*\\?(?:bmod|mod)\s*(\w+)\s*\)")


def _unknown_units(s: str) -> str:
    """The words of s's text groups beside a value that this file does not know ('' when none):
    '12 \\text{ MHz}' gives 'mhz', '\\text{about } 12' 'about'; '12 \\text{ square units}', '1 \\text{ or } 2',
    '\\text{A5}_{11}' give ''. A whole text answer and a piecewise 'cases' are compared as they are."""
    if "{cases}" in s or not re.search(r"[\dA-Za-z]", _TEXT_GROUP_RE.sub(" ", s).replace("\\boxed", "")):
        return ""
    s = s.rsplit("=", 1)[-1]        # '\\text{Area} = 50': a name left of '=', not a unit
    words = [w for m in _TEXT_GROUP_RE.finditer(s) for w in re.findall(r"[A-Za-z]+\d*",
                                                                        _unit_power_words(m.group(1), ""))]
    return " ".join(w.lower() for w in words if not (w in _UNIT_DIMS or len(w) == 1 or w[-1].isdigit() or
                                                     w.lower() in _KNOWN_WORDS))


def _same_marks(pred: str, gold: str, up, ug) -> bool:
    """The marks the comparison would drop agree: unknown unit text is met only by the same text; a degree sign
    never vanishes against a gold in radians; two congruences keep their moduli (fail closed on value)."""
    kp, kg = _unknown_units(pred), _unknown_units(gold)
    if (kp or kg) and kp != kg and (kp or up is not None or _TEXT_GROUP_RE.search(pred)):
        return False
    if _ANGLE_RE.search(pred) and not _ANGLE_RE.search(gold) and re.search(r"\\pi|π|rad", gold) and \
            not re.search(r"sin|cos|tan|sec|csc|cot", pred):
        return False
    mp, mg = _MODULUS_RE.findall(pred), _MODULUS_RE.findall(gold)
    norm = [{re.sub(r"[{}\s]", "", a or b) for a, b in m} for m in (mp, mg)]
    return not (mp and mg and norm[0] != norm[1])


# Decimal commas (departure 19): '3,25' and '0,125' cannot be thousands separators; '1,250' can.
_DEC_COMMA_RE = re.compile(r"^([+-]?\d+)(?:,|\{,\})(\d{1,2}|\d{4,})(?=%?$)|^([+-]?0)(?:,|\{,\})(\d+)(?=%?$)")
_UNPARSED_OPERATOR_RE = re.compile(r"\\(?:lim|int|iint|oint|partial|nabla|det|sum|prod|mathrm|frac|operatorname)"
                                   r"(?![a-zA-Z])")
_TEXT_NAME_RE = re.compile(r"\s*(?:[A-Za-z](?:_\{?[A-Za-z0-9]{1,3}\}?)?\s*[:/]?\s*){1,6}")   # V_1 : V_2
_LONE_DECIMAL_RE = re.compile(r"^[+-]?\d+\.\d+%?$")


def _right_of_last_equals(s: str) -> str | None:
    """What follows the last '=' outside braces and brackets, when the text before it does not parse
    (a limit, an integral, a determinant): the chain's last value (departure 17)."""
    depth, last = 0, -1
    for k, c in enumerate(s):
        if c in "{([":
            depth += 1
        elif c in "})]":
            depth -= 1
        elif c == "=" and depth == 0 and s[k - 1:k] not in ("<", ">", "!", "\\"):
            last = k
    tail = s[last + 1:].strip() if last > 0 else ""
    return tail if tail and not _INEQ_RE.search(tail) else None


def _sides_after_unparsed(s: str) -> list[str]:
    """The sides of a chain after its first one: its top-level '=' splits ('\\int_0^1 x\\,dx = \\frac12 = 0.5'
    -> ['\\frac12', '0.5']); [] when there is no '='."""
    depth, cuts = 0, []
    for k, c in enumerate(s):
        if c in "{([":
            depth += 1
        elif c in "})]":
            depth -= 1
        elif c == "=" and depth == 0 and k > 0 and s[k - 1:k] not in ("<", ">", "!", "\\"):
            cuts.append(k)
    return [s[a + 1:b].strip() for a, b in zip(cuts, cuts[1:] + [len(s)])]


def _named_text_equal(named: str, other: str) -> bool:
    """'V_1 : V_2 = 3 : 11' and '3:11', neither parsed (a ratio of two-digit numbers reads as a clock
    time): equal as text after the name, when the name has no digit outside its subscripts."""
    tail = _right_of_last_equals(named)
    return tail is not None and _norm_text(tail) == _norm_text(other) and not _has_undefined(named) and \
        _TEXT_NAME_RE.fullmatch(named[:len(named) - len(tail)].rstrip()[:-1]) is not None


def _no_thousands(s: str) -> str:
    return s.replace(",", "") if _PLAIN_THOUSANDS_RE.match(s) else s


def _decimal_comma_equal(cp: str, cg: str, rel_tol: float, budget: _Budget) -> bool:
    """A decimal comma read as a point: in the prediction against a single number; in the gold
    only against a lone decimal written with a point (a gold '2,5' is more often the list 2, 5)."""
    dp = _DEC_COMMA_RE.sub(lambda m: f"{m.group(1) or m.group(3)}.{m.group(2) or m.group(4)}", cp)
    dg = _DEC_COMMA_RE.sub(lambda m: f"{m.group(1) or m.group(3)}.{m.group(2) or m.group(4)}", cg) \
        if _LONE_DECIMAL_RE.match(dp) else cg
    if (dp, dg) == (cp, cg):
        return False
    try:
        qa, qb = _parse(dp, budget, as_gold=False), _parse(dg, budget, as_gold=True)
    except _ParseError:
        return False
    return isinstance(qa, Val) and isinstance(qb, Val) and not _free_names(qa.expr) \
        and not _free_names(qb.expr) and _equal(qa, qb, rel_tol, budget)


def _unwrap_answer(s: str, gold: bool = False) -> str:
    """An answer string without what surrounds it: the box(es) of a boxed answer or of a whole worked
    solution, or the math delimiters around it ('$\\frac25.$', '\\[ 7 \\]', '\\( 7 \\)'). A gold's last box
    is its answer whatever follows it (the tail rule judges responses, not golds)."""
    s = _LEAD_CUE_RE.sub("", s.strip(), count=1)     # 'Answer: \\[ 14 \\]', 'Answer $ 14 $'
    if "\\boxed" in s or "\\fbox" in s:
        boxes = _last_boxes(_end_of_turn(s)) or (gold and last_boxed(s) is not None and [last_boxed(s)])
        if boxes:
            return _join(boxes)
    m = _MATH_SPAN_RE.fullmatch(s.rstrip(" .,;"))
    if m:
        return _tidy(next(g for g in m.groups() if g is not None))
    if _ANSWER_PHRASE_RE.search(s):     # 'The answer is 5'
        return _after_phrase(s) or s
    if _is_prose(s):                   # 'Therefore $x \\geq 5$ is the solution.': as from a response
        plain = not re.search(r"[\^*/=()\[\]{}\\<>|_]", _MATH_SPAN_RE.sub(" ", s))
        return extract_answer(s, last_number=plain) or s    # 'It costs 3,15 €.': its last number
    return s


def _is_prose(s: str) -> bool:
    """A sentence, not an answer: words outside math spans and \\text{..} (two around a math span,
    else three of three letters or more) and a digit somewhere."""
    if len(s) > 4 * MAX_ANSWER_CHARS:
        return False
    bare = _MATH_SPAN_RE.sub(" ", re.sub(r"\\[A-Za-z]+\s*(?:\{[^{}]*\})?", " ", s))
    if not re.search(r"\d", s) or _SYMPY_HINT_RE.search(s):
        return False
    if bare != re.sub(r"\\[A-Za-z]+\s*(?:\{[^{}]*\})?", " ", s):      # math spans in a sentence
        return len(re.findall(r"(?<![A-Za-z\\])[A-Za-z]{2,}(?![A-Za-z])", bare)) >= 2
    words = re.findall(r"(?<![A-Za-z\\])[A-Za-z]{3,}(?![A-Za-z])", bare)
    n = sum(w not in _FUNCS and w not in _CONST_WORDS for w in words)    # not 'cos(t)+sin(t)'
    return n >= 3 or n >= 2 and re.search(r"\.\s*$|\s(?:is|are)\s", s) is not None   # 'The area is 2 m².'


def _has_undefined(s: str) -> bool:
    return bool(re.search(r"(?<![A-Za-z])(?:nan|zoo|NaN)(?![A-Za-z])", s))


