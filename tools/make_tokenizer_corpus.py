#!/usr/bin/env python3
"""Writes tests/fixtures/tokenizers/corpus.txt: the deterministic text corpus on which opd's
tokenizer is compared with Hugging Face `tokenizers`, line by line.

One test case per line ('\n' separates lines; '\r' and every other byte belong to the line).
The file is deliberately NOT valid UTF-8 everywhere: about 2% of the lines carry raw invalid
bytes (truncated sequences, stray continuation bytes, overlong forms, surrogates, > U+10FFFF).
Both sides read a line as bytes; the oracle decodes it with errors="replace" and opd applies the
same maximal-subpart U+FFFD rule itself (src/tokenizer/utf8.h).

Content: ASCII prose with contractions in every case ('s 'T 'LL ...), CJK (Chinese, Japanese,
Korean incl. conjoining jamo), Arabic and Hebrew with marks, Indic, Thai, Cyrillic, Greek, emoji
(skin tones, ZWJ sequences, flags, keycaps, variation selectors), source code, long runs of
spaces, tabs, \r, vertical tab, form feed, NEL and other Unicode spaces, digits and long
numbers, special-token strings (<|im_start|>, <|endoftext|>, <think>, <|begin_of_text|> ...)
embedded in text, NFC edge cases (decomposed letters, mark reordering, singletons, composition
exclusions, marks newer than HF's normalizer), letters and digits added in Unicode 15/16,
random code points, and a few very long lines.

Usage: python3 tools/make_tokenizer_corpus.py [OUT]   (default: the fixture path)
"""
import os
import random
import sys

SEED = 20260611
N_LINES = 12000

WORDS = """the of and to in is was he for it with as his on be at by had are but from or have an
they which one you were all we her she there would their will when who him been has more if no
out so said what up its about than into them can only other time new some could these two may
first then do any like my now over such our man me even most made after also did many off
before must well back through years much where your way down should because long each just
state people those too how little good world very still own see men work government day make
life between both under never being same another know while last might us great old year come
since against go came right used take three himself few house use during without again place
American around however home small found Mrs thought went say part once general high upon
school every don't does got united left number course war until always away something fact
though water less public put think almost hand enough far took head yet system better set told
nothing night end why called didn't eyes find going look asked later knew point next program
city business give group toward young days let room president side social present given
several order national possible rather second face per among form important often things
looked early white case John become large big need four within felt children along saw best
church ever least power development light""".split()

CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'VE", "'M",
                "'LL", "'D", "'Ll", "'lL", "'Re", "n't", "N'T", "’s", "’ll", "'ſ", "'K", "''",
                "'", "'x", "'sss", "'tis", "'18"]

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>",
            "</tool_call>", "<tool_response>", "<|fim_prefix|>", "<|object_ref_start|>",
            "<|vision_pad|>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_5|>",
            "<|finetune_right_pad_id|>", "<|python_tag|>", "<|im_sta", "im_end|>", "<|", "|>",
            "<|im_start|", "<<|im_end|>>", "<|IM_START|>", "< |im_start| >", "<|endoftext|><|endoftext|>"]

CJK_SENTENCES = [
    "我们在北京大学学习机器学习和自然语言处理。", "今天天气很好，我们去公园散步吧！",
    "深度学习模型需要大量的数据和计算资源。", "这是一个测试句子，包含标点符号：逗号、句号。",
    "日本語の文章もテストします。ひらがなとカタカナと漢字。", "東京都渋谷区で会議があります。",
    "컴퓨터 과학은 매우 흥미로운 분야입니다.", "안녕하세요, 만나서 반갑습니다!",
    "全角数字１２３４５と全角英字ＡＢＣ。", "「引用」『二重引用』【括弧】〔亀甲〕",
]
ARABIC = ["مرحبا بالعالم، كيف حالك اليوم؟", "الذكاء الاصطناعي يغير العالم بسرعة كبيرة.",
          "بِسْمِ اللَّهِ الرَّحْمَٰنِ الرَّحِيمِ", "العدد ١٢٣٤٥٦٧٨٩٠ بالأرقام العربية الهندية",
          "שלום עולם, מה שלומך?", "בְּרֵאשִׁית בָּרָא אֱלֹהִים", "فارسی: سلام دنیا ۱۲۳۴"]
OTHER_SCRIPTS = ["Привет, мир! Как дела? ЁЖИК ёжик", "Ελληνικά: καλημέρα κόσμε, ΣΊΣΥΦΟΣ σοφός",
                 "हिन्दी में लिखा गया वाक्य। क्षत्रिय", "ภาษาไทยไม่มีช่องว่างระหว่างคำ",
                 "ქართული ენა", "አማርኛ ቋንቋ", "Tiếng Việt có nhiều dấu: Nguyễn Thị Hằng",
                 "Čeština, Dansk æøå, Deutsch ÄÖÜß, Français œ ç, Español ñ ¿¡", "𝐀𝐁𝐂 𝔸𝔹ℂ 𝒜 ℌ ℍ",
                 "Ⅻ ½ ¾ ² ³ ⁴ ₅ ① ⑳ ٣ ۳ ߃ ๓ ໓ ༣"]
EMOJI = ["👍", "👍🏻", "👍🏿", "👩‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷", "🇯🇵🇺🇸", "1️⃣", "#️⃣", "❤️", "❤",
         "🧑🏽‍🚀", "🤷‍♀️", "🫠", "🦀", "😀😃😄", "🙂‍↔️", "🐈‍⬛", "👁️‍🗨️", "©️", "™", "☕"]
CODE = [
    "def f(x):\n    return x ** 2  # square",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "#include <vector>\nint main() { std::vector<int> v{1, 2, 3}; return v.size(); }",
    '{"key": "value", "list": [1, 2.5, -3e10, null, true], "nested": {"a": "b"}}',
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name HAVING COUNT(*) > 1;",
    "fn main() { let x: Vec<u8> = vec![0xFF; 16]; println!(\"{:?}\", x); }",
    "<div class=\"container\"><p>Hello &amp; welcome</p></div>",
    "if [[ -n \"$VAR\" ]]; then echo \"${VAR:-default}\" | grep -E '^[a-z]+$'; fi",
    "x = lambda a, b: a if a > b else b\t# tab comment",
    "const re = /\\s+(?!\\S)/gu; // regex literal",
    "    \t    mixed_indent = True",
    "\t\tdouble_tab(); \t trailing\t",
    "a_b_c__d___e", "CamelCaseIdentifierHTTPServer2", "snake_case_v2_final_FINAL",
    "https://example.com/path?query=1&other=two#frag", "user@example.org", "C:\\Users\\name\\file.txt",
]
NFC_CASES = ["e\u0301", "cafe\u0301", "A\u030A", "\u212B", "\u2126", "\u0958", "a\u0316\u0301",
             "a\u0301\u0316", "o\u0308\u0304", "\u1100\u1161\u11A8", "\u1100\u1161", "\uAC00\u11A8",
             "\u0344", "\u0F73", "\uFB01", "\u00C5\u0301", "q\u0307\u0323", "\u1E0B\u0323",
             "a\u1AC1\u0316", "a\u0316\u1AC1", "\U00011935\U00011930", "\U00011938", "x\u0334\u0301",
             "\u05D0\u05B7\u05BC", "\u0627\u0653", "\u0627\u0654", "\u09C7\u09BE", "\u0B47\u0B56",
             "\u1025\u102E", "\u3099\u304B", "\u304B\u3099", "\u30AB\u309A", "e\u0301\u0301\u0301"]
NEW_UNICODE = ["\u1C89\u1C8A", "\U00031350\U00031351\U00031352", "\U0002EBF0\U0002EBF1",
               "\U00016D70\U00016D71", "\U0001E5D0\U0001E5D1", "\uA7CB\uA7CC", "\U000105C0\U000105C1",
               "\U00010D40\U00010D41\U00010D42", "\U0001CCF0"]
SPACES = [" ", "  ", "\t", "\r", "\r\r", "\x0b", "\x0c", "\u00a0", "\u3000", "\u2028", "\u2029",
          "\u0085", "\u200b", "\u2003", "\u202f", "\u1680", "\ufeff", "\u180e", " \t \r "]
INVALID = [b"\x80", b"\xff", b"\xfe", b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\xc0\xaf",
           b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80",
           b"\xc3\x28", b"\xa0\xa1", b"\xe2\x28\xa1", b"\xf0\x28\x8c\xbc", b"\x80\x80\x80"]


def prose(r, n_words):
    out = []
    for i in range(n_words):
        w = r.choice(WORDS)
        if r.random() < 0.1:
            w = w.capitalize()
        if r.random() < 0.03:
            w = w.upper()
        if r.random() < 0.08:
            w += r.choice(CONTRACTIONS)
        out.append(w)
        if r.random() < 0.1:
            out[-1] += r.choice([",", ".", ";", ":", "!", "?", "...", " -", " —", "\"", ")"])
    s = " ".join(out)
    return s[0].upper() + s[1:] if s else s


def number(r):
    k = r.randrange(6)
    if k == 0:
        return str(r.randrange(10 ** r.randrange(1, 40)))
    if k == 1:
        return f"{r.uniform(-1e6, 1e6):.{r.randrange(0, 12)}f}"
    if k == 2:
        return f"{r.randrange(1, 9)}.{r.randrange(10**8)}e{r.choice(['+', '-', ''])}{r.randrange(300)}"
    if k == 3:
        return ",".join(str(r.randrange(1000)).zfill(3) for _ in range(r.randrange(1, 6)))
    if k == 4:
        return "".join(r.choice("0123456789") for _ in range(r.randrange(50, 400)))
    return f"v{r.randrange(10)}.{r.randrange(100)}.{r.randrange(1000)}-rc{r.randrange(5)}"


def random_codepoints(r, n):
    out = []
    for _ in range(n):
        plane = r.random()
        if plane < 0.5:
            c = r.randrange(0x20, 0x3000)
        elif plane < 0.8:
            c = r.randrange(0x3000, 0x10000)
        else:
            c = r.randrange(0x10000, 0x110000)
        if 0xD800 <= c <= 0xDFFF or c == 0x0A:
            c = 0xFFFD
        out.append(chr(c))
    return "".join(out)


def mix(r):
    parts = []
    for _ in range(r.randrange(2, 8)):
        k = r.randrange(10)
        if k == 0:
            parts.append(prose(r, r.randrange(1, 8)))
        elif k == 1:
            parts.append(r.choice(CJK_SENTENCES))
        elif k == 2:
            parts.append(r.choice(ARABIC + OTHER_SCRIPTS))
        elif k == 3:
            parts.append("".join(r.choice(EMOJI) for _ in range(r.randrange(1, 4))))
        elif k == 4:
            parts.append(r.choice(SPECIALS))
        elif k == 5:
            parts.append(number(r))
        elif k == 6:
            parts.append("".join(r.choice(SPACES) for _ in range(r.randrange(1, 6))))
        elif k == 7:
            parts.append(r.choice(NFC_CASES))
        elif k == 8:
            parts.append(r.choice(CODE).replace("\n", r.choice(["\\n", " ", "\r"])))
        else:
            parts.append(r.choice(NEW_UNICODE))
    sep = r.choice(["", " ", "  ", "\t"])
    return sep.join(parts)


def line_bytes(r, i):
    """The i-th line as bytes (without the newline)."""
    k = i % 20
    if k < 5:
        s = prose(r, r.randrange(1, 60))
    elif k == 5:
        s = r.choice(CJK_SENTENCES) + r.choice(["", " ", "\t"]) + r.choice(CJK_SENTENCES)
        if r.random() < 0.5:
            s = "".join(r.choice(s) for _ in range(r.randrange(1, 80)))
        if r.random() < 0.3:  # random Hangul syllables and CJK ideographs
            s += "".join(chr(r.randrange(0xAC00, 0xD7A4)) for _ in range(r.randrange(1, 20)))
            s += "".join(chr(r.randrange(0x4E00, 0xA000)) for _ in range(r.randrange(1, 20)))
    elif k == 6:
        s = " ".join(r.choice(ARABIC + OTHER_SCRIPTS) for _ in range(r.randrange(1, 4)))
    elif k == 7:
        s = prose(r, r.randrange(0, 6)) + " " + "".join(
            r.choice(EMOJI) + r.choice(["", " ", "", "\u200d", "\ufe0f"]) for _ in range(r.randrange(1, 12)))
    elif k == 8:
        s = r.choice(CODE)
        s = s.replace("\n", r.choice(["\\n", "\r", " ", "\t"]))
    elif k == 9:
        w = "".join(r.choice(SPACES) for _ in range(r.randrange(1, 6)))
        s = w * r.randrange(1, 40) + prose(r, r.randrange(0, 5)) + w * r.randrange(0, 40)
    elif k == 10:
        s = " ".join(number(r) for _ in range(r.randrange(1, 6)))
        if r.random() < 0.5:
            s = prose(r, 3) + s + "abc" + number(r) + "def"
    elif k == 11:
        s = prose(r, r.randrange(0, 10)) + r.choice(["", " ", "  ", "\n".replace("\n", "\t")]) + \
            r.choice(SPECIALS) + r.choice(["", " ", "\t", "  "]) + prose(r, r.randrange(0, 10))
        if r.random() < 0.3:
            s = "".join(r.choice(SPECIALS) + r.choice(["", " ", "x"]) for _ in range(r.randrange(2, 6)))
    elif k == 12:
        s = prose(r, 3) + " " + " ".join(r.choice(NFC_CASES) for _ in range(r.randrange(1, 6)))
    elif k == 13:
        s = " ".join(w + r.choice(CONTRACTIONS) for w in r.sample(WORDS, r.randrange(1, 10)))
    elif k == 14:
        s = random_codepoints(r, r.randrange(1, 40))
    elif k == 15:
        s = mix(r)
    elif k == 16:
        b = prose(r, r.randrange(1, 10)).encode()
        pos = r.randrange(len(b) + 1)
        return b[:pos] + r.choice(INVALID) + b[pos:] if r.random() < 0.4 else \
            r.choice(INVALID) + " ".join(r.choice(CJK_SENTENCES + EMOJI) for _ in range(2)).encode() + r.choice(INVALID)
    elif k == 17:
        s = " ".join(r.choice(NEW_UNICODE) + r.choice(["", "a", "1", " "]) for _ in range(r.randrange(1, 5)))
    elif k == 18:
        s = r.choice(["", " ", "\t", "\r", "a", ".", "'", "'s", "0", "00", "000", "0000"]) if r.random() < 0.5 \
            else "".join(chr(r.randrange(0, 0x80)) for _ in range(r.randrange(1, 30))).replace("\n", " ")
    else:
        s = mix(r)
    return s.encode("utf-8")


def long_lines():
    """A handful of very long lines (regex backtracking, word cache bypass, big BPE words)."""
    return [b" " * 20000, b"\t" * 5000 + b"x", b"a" * 8000, b"9" * 10000, ("ab" * 3000).encode(),
            ("\u4e2d\u6587" * 2000).encode(), (" x" * 5000).encode(), b"\r" * 3000 + b"\x0b",
            ("e\u0301" * 1000).encode(), ("👍🏽" * 500).encode(), ("<|im_start|>" * 300).encode(),
            b"\xff" * 100 + b"tail", ("Hello world! " * 800).encode()]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "..", "tests", "fixtures", "tokenizers", "corpus.txt")
    r = random.Random(SEED)
    lines = [line_bytes(r, i) for i in range(N_LINES)] + long_lines()
    for b in lines:
        assert b"\n" not in b
    with open(out, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    print(f"{out}: {len(lines)} lines, {sum(map(len, lines))} bytes")


if __name__ == "__main__":
    main()
