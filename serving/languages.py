"""The languages a transcription request may name, and the name OpenAI's verbose_json reports for each.

Two sets, as vLLM checks a transcription's `language` (its SupportsTranscription.validate_language):
`SUPPORTED`, OpenAI's transcription languages (its speech-to-text guide; vLLM's ISO639_1_SUPPORTED_LANGS),
taken as they are, and `OTHER`, the rest of Whisper's language map (vLLM's ISO639_1_OTHER_LANGS, with `yue`
since vLLM reads the map itself), taken with a warning that the transcript may be less accurate. A code is
ISO-639-1, or ISO-639-3 where Whisper has no two-letter one (`haw`, `yue`); Whisper's `jw` is its own spelling
of Javanese. Anything else is refused, as vLLM refuses it (Irish, `ga`, is in neither set). The names are
Whisper's, which OpenAI reports: `en` -> `english`.
"""


def _table(text: str) -> dict[str, str]:
    """code -> name from `code:name` pairs; `_` stands for a space in a name."""
    return {code: name.replace("_", " ") for code, name in (pair.split(":") for pair in text.split())}


SUPPORTED = _table("""
    af:afrikaans ar:arabic hy:armenian az:azerbaijani be:belarusian bs:bosnian bg:bulgarian ca:catalan zh:chinese
    hr:croatian cs:czech da:danish nl:dutch en:english et:estonian fi:finnish fr:french gl:galician de:german
    el:greek he:hebrew hi:hindi hu:hungarian is:icelandic id:indonesian it:italian ja:japanese kn:kannada
    kk:kazakh ko:korean lv:latvian lt:lithuanian mk:macedonian ms:malay mr:marathi mi:maori ne:nepali
    no:norwegian fa:persian pl:polish pt:portuguese ro:romanian ru:russian sr:serbian sk:slovak sl:slovenian
    es:spanish sw:swahili sv:swedish tl:tagalog ta:tamil th:thai tr:turkish uk:ukrainian ur:urdu vi:vietnamese
    cy:welsh""")
OTHER = _table("""
    sq:albanian am:amharic as:assamese eu:basque ba:bashkir bn:bengali br:breton yue:cantonese fo:faroese
    ka:georgian gu:gujarati ht:haitian_creole ha:hausa haw:hawaiian jw:javanese km:khmer lo:lao la:latin
    ln:lingala lb:luxembourgish mg:malagasy ml:malayalam mt:maltese mn:mongolian my:myanmar nn:nynorsk
    oc:occitan ps:pashto pa:punjabi sa:sanskrit sn:shona sd:sindhi si:sinhala so:somali su:sundanese tg:tajik tt:tatar
    te:telugu bo:tibetan tk:turkmen uz:uzbek yi:yiddish yo:yoruba""")
_NAMES = {**SUPPORTED, **OTHER}
_CODES = {name: code for code, name in _NAMES.items()}


def find_language(value: str) -> str | None:
    """The code of the language `value` names, by its code or its name, in any case; None when it names none."""
    text = value.strip().lower()
    return text if text in _NAMES else _CODES.get(text)


def language_name(code: str) -> str:
    return _NAMES[code]
